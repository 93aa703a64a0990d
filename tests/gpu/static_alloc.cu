// A program built by nvcc with its default static cudart: no libcudart.so to probe, yet its
// cudaMalloc still reaches libcuda's cuMemAlloc_v2 (FACTS.md), which the driver probes see.
#include <cstdio>
#include <unistd.h>
int main() {
    void *p = nullptr;
    if (cudaMalloc(&p, 123u << 20) != cudaSuccess) return 2;
    printf("allocated 1 %u pid=%d\nready\n", 123u << 20, getpid());
    fflush(stdout);
    getchar();
    cudaFree(p);
    printf("freed 1 %u\nexit\n", 123u << 20);
    return 0;
}
