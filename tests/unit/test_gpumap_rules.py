"""probes/gpumap.py: CUDA ordinals to host GPUs, from CUDA_VISIBLE_DEVICES as the driver reads
it and the /dev/nvidiaN nodes the kernel says a process opened (no root, no kernel needed for
the pure part; the /proc readers run on this test's own process)."""
import os

from convgpu.probes import gpumap
from convgpu.probes.gpumap import Mapping, check, resolve, visible
from convgpu.probes.nvml import GpuInfo

U = ["GPU-85b57131-c9bc-8376-422f-41fee47a6159", "GPU-85b5aaaa-0000-0000-0000-000000000001",
     "GPU-1f000000-0000-0000-0000-000000000002", "GPU-2e000000-0000-0000-0000-000000000003"]
H100 = [GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 << 30, 0, U[i], i) for i in range(4)]
MIXED = [GpuInfo(0, "NVIDIA A100", 80 << 30, 0, U[0], 0), GpuInfo(1, "NVIDIA H100", 80 << 30, 0, U[1], 1)]


def test_visible_devices_as_the_driver_reads_them():
    assert visible(None, H100, None) == [0, 1, 2, 3]
    assert visible("", H100, None) == []                       # set and empty: no GPU
    assert visible("1", H100, None) == [1]
    assert visible("1,0", H100, None) == [1, 0]
    assert visible("3,1,7,0", H100, None) == [3, 1]             # 7 is no GPU: the list ends there
    assert visible("2,2,0", H100, None) == [2]                  # a repeat ends it too
    assert visible("1", H100[:1], None) == []                   # FACTS: =1 on a 1-GPU host sees none
    assert visible(U[2], H100, None) == [2]
    assert visible("GPU-1f", H100, None) == [2]                 # a prefix naming one GPU
    assert visible("GPU-85b5", H100, None) == []                # a prefix of two names none
    assert visible(f"{U[3]},0", H100, None) == [3, 0]
    assert visible("x,1", H100, None) == []
    assert visible("MIG-4f2b1c9e-1111-2222-3333-444444444444", H100, None) is None   # NVML lists no instance


MIG = ["MIG-4f2b1c9e-1111-2222-3333-444444444444", "MIG-4f2b77aa-0000-0000-0000-000000000001",
       "MIG-90000000-0000-0000-0000-000000000002"]
WITH_MIG = [GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 << 30, 0, U[0], 0, (MIG[0], MIG[1])),
            GpuInfo(1, "NVIDIA H100 80GB HBM3", 80 << 30, 0, U[1], 1, (MIG[2],))]


def test_a_mig_instance_is_its_parent_gpu():
    """MIG instances are slices of their parent's memory; books and limits are per physical GPU."""
    assert visible(MIG[2], WITH_MIG, None) == [1]
    assert visible(MIG[0], WITH_MIG, None) == [0]
    assert visible("MIG-4f2b7", WITH_MIG, None) == [0]          # a prefix naming one instance
    assert visible("MIG-4f2b", WITH_MIG, None) == []            # a prefix of two names none
    assert visible(f"MIG-{U[1]}/1/0", WITH_MIG, None) == [1]    # the old form names the parent
    assert visible(f"{MIG[2]},{MIG[0]}", WITH_MIG, None) == [1, 0]
    assert visible(f"{MIG[0]},{MIG[1]}", WITH_MIG, None) == [0]  # two slices of one GPU: one GPU
    assert visible("MIG-77000000-0000-0000-0000-000000000000", WITH_MIG, None) == []   # none such
    assert resolve(visible(MIG[2], WITH_MIG, None), {1}, WITH_MIG).hosts == (1,)


def test_indexes_on_mixed_cards_depend_on_an_order_only_pci_bus_id_fixes():
    assert visible("0", MIXED, None) is None                    # FASTEST_FIRST: which is fastest?
    assert visible("0", MIXED, "FASTEST_FIRST") is None
    assert visible("0", MIXED, "PCI_BUS_ID") == [0]
    assert visible(U[1], MIXED, None) == [1]                    # a UUID needs no order


def test_the_kernel_fixes_the_mapping_and_the_environment_is_only_a_hint():
    m = resolve([1], {1}, H100)
    assert m == Mapping((1,), True, "CUDA_VISIBLE_DEVICES names the GPUs it opened", (), (1,), (1,))
    assert resolve([1, 0], {0, 1}, H100).hosts == (1, 0) and resolve([1, 0], {0, 1}, H100).certain
    lie = resolve([0], {1}, H100)          # says GPU 0, opened only GPU 1's node
    assert (lie.hosts, lie.certain, lie.also) == ((1,), True, ())
    assert "not believed" in lie.how
    some = resolve([1], {0, 1}, H100)      # opened more than it names: charged to all it opened
    assert (some.hosts, some.certain, some.also) == ((1,), False, (0, 1))
    blind = resolve(None, {2, 3}, H100)
    assert (blind.hosts, blind.certain, blind.also) == ((2, 3), False, (2, 3))
    none = resolve([2], set(), H100)       # no node open: the hint, charged everywhere
    assert (none.hosts, none.certain, none.also) == ((2,), False, (0, 1, 2, 3))
    assert resolve([], set(), H100) == Mapping((), True, "CUDA_VISIBLE_DEVICES is empty: it sees no GPU",
                                               (), (), ())
    assert resolve(None, None, []).host(1) == 1     # no inventory (no NVML): the ordinal stands


def test_nvml_lists_are_the_check():
    m = resolve([1], {1}, H100)
    assert check(m, {1}) is None
    assert check(m, {0, 1}) == "NVML lists it on GPU0, which its mapping [1] does not have"


def test_bpf_rows_carry_every_ordinal_and_the_also_row():
    m = resolve([1], {0, 1}, H100)
    assert gpumap.bpf_entries(7, m, True) == [(7 << 32, 1, 0), (7 << 32 | 0xFFFFFFFF, -1, 0b11)]
    assert gpumap.bpf_entries(7, m, False)[-1] == (7 << 32 | 0xFFFFFFFF, -1, 0)


def test_proc_readers_on_this_process(tmp_path):
    os.environ["CUDA_VISIBLE_DEVICES"] = "GPU-x"
    try:
        # /proc/self/environ is the environment at exec: a variable set since is not in it
        env = gpumap.read_env(os.getpid(), ("CUDA_VISIBLE_DEVICES", "PATH"))
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    assert env is not None and "PATH" in env
    fd = os.open("/dev/null", os.O_RDONLY)      # char 1:3, but not named like the driver's nodes
    link = tmp_path / "nvidia7"
    os.symlink("/dev/zero", link)               # opened through a link: the fd names /dev/zero
    fd2 = os.open(link, os.O_RDONLY)
    try:
        assert gpumap.opened_minors(os.getpid(), 1) == set()
    finally:
        os.close(fd)
        os.close(fd2)
    assert gpumap.opened_minors(2 ** 22 + 1, 1) is None
    assert gpumap.nvidia_major(str(tmp_path / "missing")) == 195
    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n\nBlock devices:\n195 x\n")
    assert gpumap.nvidia_major(str(tmp_path / "devices")) == 195
    (tmp_path / "devices").write_text("Character devices:\n  1 mem\n236 nvidia\n")
    assert gpumap.nvidia_major(str(tmp_path / "devices")) == 236


def test_fuse_mounts_are_never_stated():
    info = (b"24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw\n"
            b"31 24 0:40 / /dev/nvidia1 rw shared:5 - fuse.evil evil rw,user_id=0\n"
            b"32 24 0:41 / /x rw - fuseblk x rw\n"
            b"garbage line\n")
    assert gpumap.fuse_mounts(info) == {31, 32}
