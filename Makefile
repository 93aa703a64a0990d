# convgpu top-level Makefile: builds the test-only stand-in CUDA driver and
# runtime plus the caller programs used by the tests.  Output under build/.
# Needs only gcc and binutils (no CUDA toolkit).  See tests/standin/README.md.

CC ?= gcc
BUILD ?= build
SI := tests/standin
OUT := $(BUILD)/standin

WARN := -Wall -Wextra
# The stand-in libraries are probed with uprobes, so every exported function
# must begin with `push %rbp` like the real driver's: -O0 keeps the frame
# setup in every function (-O2 drops it in leaf functions) and
# -fcf-protection=none keeps endbr64 from being the first instruction.
# Checked by `make check-prologue`.
STANDIN_CFLAGS := -std=gnu11 -O0 -g -fno-omit-frame-pointer -fcf-protection=none \
	-fPIC -fvisibility=hidden -pthread $(WARN)
STANDIN_LDFLAGS := -shared -pthread -Wl,--no-undefined
# The callers are not probed.
CALLER_CFLAGS := -std=gnu11 -O2 -g -pthread $(WARN)

LIBCUDA_SRCS := $(SI)/libcuda.c $(SI)/libcuda_mem.c $(SI)/libcuda_limits.c $(SI)/libcuda_graph.c \
	$(SI)/libcuda_module.c $(SI)/libcuda_cp.c $(SI)/libcuda_cp_api.c $(SI)/libcuda_copy.c $(SI)/standin_shm.c $(SI)/visible.c
LIBCUDA_HDRS := $(SI)/cuda_min.h $(SI)/libcuda_int.h $(SI)/standin_shm.h

# Symbols the stand-in driver must export (check-prologue verifies).
LIBCUDA_SYMS := cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetCount \
	cuDeviceGetName cuDeviceGetAttribute cuDeviceGetUuid cuDeviceGetUuid_v2 cuDeviceTotalMem_v2 cuGetProcAddress_v2 cuGetErrorString \
	cuMemAlloc_v2 cuMemAllocPitch_v2 cuMemAllocManaged cuMemFree_v2 \
	cuMemGetInfo_v2 cuMemCreate cuMemRelease cuMemMap cuMemUnmap \
	cuMemAddressReserve cuMemAddressFree cuMemSetAccess \
	cuMemGetAllocationGranularity cuMemAllocAsync cuMemAllocAsync_ptsz \
	cuMemAllocFromPoolAsync cuMemAllocFromPoolAsync_ptsz cuMemFreeAsync \
	cuMemFreeAsync_ptsz cuDeviceGetDefaultMemPool cuStreamSynchronize \
	cuCtxSynchronize cuArrayCreate_v2 cuArray3DCreate_v2 \
	cuMipmappedArrayCreate cuArrayDestroy cuMipmappedArrayDestroy \
	cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease_v2 cuCtxCreate_v2 \
	cuCtxCreate_v3 cuCtxCreate_v4 cuCtxDestroy_v2 cuCtxSetCurrent \
	cuCtxGetCurrent cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuCtxGetDevice \
	cuCtxSetLimit cuCtxGetLimit cuMemsetD8_v2 cuStreamCreate cuStreamDestroy_v2 \
	cuStreamBeginCapture_v2 cuStreamBeginCapture_v2_ptsz cuStreamEndCapture \
	cuStreamEndCapture_ptsz cuStreamIsCapturing cuStreamIsCapturing_ptsz \
	cuGraphCreate cuGraphAddMemAllocNode cuGraphAddMemFreeNode cuGraphAddNode \
	cuGraphAddNode_v2 cuGraphInstantiateWithFlags cuGraphInstantiateWithParams \
	cuGraphInstantiateWithParams_ptsz cuGraphInstantiate cuGraphInstantiate_v2 \
	cuGraphLaunch cuGraphLaunch_ptsz cuGraphExecDestroy cuGraphDestroy \
	cuDeviceGraphMemTrim cuDeviceGetGraphMemAttribute cuModuleLoad cuModuleLoadData \
	cuModuleLoadDataEx cuModuleUnload cuLibraryLoadData cuLibraryLoadFromFile cuLibraryUnload \
	cuModuleGetFunction cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 cuMemcpyDtoD_v2 cuLaunchKernel \
	cuLaunchKernel_ptsz cuCheckpointProcessGetState cuCheckpointProcessLock \
	cuCheckpointProcessCheckpoint cuCheckpointProcessRestore cuCheckpointProcessUnlock \
	cuCheckpointProcessGetRestoreThreadId
LIBCUDART_SYMS := cudaMalloc cudaMallocManaged cudaMallocPitch cudaMalloc3D \
	cudaFree cudaMemGetInfo cudaSetDevice cudaDeviceSynchronize

NVML_OUT := $(BUILD)/standin-nvml
TARGETS := $(OUT)/libcuda.so.1 $(OUT)/libcuda.so $(NVML_OUT)/libnvidia-ml.so.1 \
	$(OUT)/libcudart.so.13 $(OUT)/libcudart.so \
	$(OUT)/standin-usage $(BUILD)/cgcaller $(BUILD)/turns $(BUILD)/alloc_bench $(BUILD)/reenter \
	$(BUILD)/holder $(BUILD)/cpctl

.PHONY: all standin check-prologue clean
all: standin check-prologue

standin: $(TARGETS)

$(OUT):
	mkdir -p $@

$(OUT)/libcuda.so.1: $(LIBCUDA_SRCS) $(LIBCUDA_HDRS) | $(OUT)
	$(CC) $(STANDIN_CFLAGS) $(STANDIN_LDFLAGS) -Wl,-soname,libcuda.so.1 \
		-o $@ $(LIBCUDA_SRCS) -ldl -lrt

# Apart from the driver (see the file): only the shim's NVML test puts it on a library path.
$(NVML_OUT)/libnvidia-ml.so.1: $(SI)/libnvidia-ml.c $(SI)/standin_shm.c $(SI)/standin_shm.h
	mkdir -p $(NVML_OUT)
	$(CC) $(STANDIN_CFLAGS) $(STANDIN_LDFLAGS) -Wl,-soname,libnvidia-ml.so.1 -o $@ $(SI)/libnvidia-ml.c \
		$(SI)/standin_shm.c -lrt

$(OUT)/libcuda.so: | $(OUT)
	ln -sf libcuda.so.1 $@

$(OUT)/libcudart.so.13: $(SI)/libcudart.c $(SI)/cuda_min.h | $(OUT)
	$(CC) $(STANDIN_CFLAGS) $(STANDIN_LDFLAGS) -Wl,-soname,libcudart.so.13 \
		-o $@ $(SI)/libcudart.c -ldl

$(OUT)/libcudart.so: | $(OUT)
	ln -sf libcudart.so.13 $@

$(OUT)/standin-usage: $(SI)/standin-usage.c $(SI)/standin_shm.c $(SI)/standin_shm.h | $(OUT)
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/standin-usage.c $(SI)/standin_shm.c -lrt

# Linked by SONAME only, no rpath: LD_LIBRARY_PATH chooses the stand-in
# (build/standin) or the real driver at run time.
$(BUILD)/cgcaller: $(SI)/cgcaller.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/cgcaller.c -L$(OUT) -l:libcuda.so.1 -ldl

# holder (a process that holds memory and works) and cpctl (a checkpointing process): by
# SONAME too, so that both run on the real driver of a GPU host unchanged.
$(BUILD)/holder: $(SI)/holder.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/holder.c -L$(OUT) -l:libcuda.so.1

$(BUILD)/cpctl: $(SI)/cpctl.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/cpctl.c -L$(OUT) -l:libcuda.so.1

$(BUILD)/turns: $(SI)/turns.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/turns.c -L$(OUT) -l:libcuda.so.1

$(BUILD)/reenter: $(SI)/reenter.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ $(SI)/reenter.c -L$(OUT) -l:libcuda.so.1 -ldl

$(BUILD)/alloc_bench: bench/alloc_bench.c $(SI)/cuda_min.h $(OUT)/libcuda.so.1
	$(CC) $(CALLER_CFLAGS) -o $@ bench/alloc_bench.c -L$(OUT) -l:libcuda.so.1 -ldl

check-prologue: $(OUT)/libcuda.so.1 $(OUT)/libcudart.so.13
	sh $(SI)/check-prologue.sh --driver $(OUT)/libcuda.so.1 cu $(LIBCUDA_SYMS)
	sh $(SI)/check-prologue.sh $(OUT)/libcudart.so.13 cuda $(LIBCUDART_SYMS)

clean:
	rm -rf $(BUILD)
