// strictnorm: asynchronous copies into shared memory and the acquire/release accesses that kernels use to
// wait for each other (fold.cu, onepass.cu). The CPU emulation (bench/emulate/shim.h) supplies the primitives.
#pragma once

#ifndef STRICTNORM_EMULATED
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// counter += v with release semantics at GPU scope (the writes ordered before it, by a barrier too, are
// visible to whoever acquires the new value): no full fence
__device__ __forceinline__ void add_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long load_acquire64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release64(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A barrier among `threads` threads (whole warps) of the block, by id (0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Shared-memory barriers with phases (mbarrier): `count` arrivals complete a phase; a waiter names the phase by
// its parity (use k of a barrier: k & 1) and must have seen phase k - 1 complete before waiting for phase k.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(s), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(s) : "memory");
}
// A wait past 2 s traps (a launch error) rather than hang the device: a lost phase is a bug. On sm_90 the
// hardware may suspend a waiting thread (try_wait) instead of letting it spin on the issue slots.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, int parity) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
#if __CUDA_ARCH__ >= 900
#define STRICTNORM_MBAR_TEST "mbarrier.try_wait.parity"
#else
#define STRICTNORM_MBAR_TEST "mbarrier.test_wait.parity"
#endif
    auto done = [&] {
        unsigned d;
        asm volatile("{\n.reg .pred p;\n" STRICTNORM_MBAR_TEST ".shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                     : "=r"(d) : "r"(s), "r"(parity) : "memory");
        return d != 0;
    };
#undef STRICTNORM_MBAR_TEST
    if (done()) return;
    const unsigned long long start = global_ns();
    while (!done())
        if (global_ns() - start > 2000000000ull) __trap();
}
// Whether the phase of the given parity has completed, without waiting (a thread may test early and wait later).
__device__ __forceinline__ bool mbar_test(unsigned long long* bar, int parity) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
    unsigned d;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(d) : "r"(s), "r"(parity) : "memory");
    return d != 0;
}
#endif

// The phase parity an mbar_wait names for the use of a barrier by `item` (0, 1, ...), when `count` barriers are
// taken in turn: the barrier's (item / count)-th completion.
__device__ __forceinline__ int mbar_use_parity(long long item, int count) {
    return static_cast<int>((item / count) & 1);
}

// One 16-byte chunk of a row segment from column c on: fewer bytes, zero-filled, past column n.
template <typename T>
__device__ __forceinline__ void copy_chunk(unsigned char* dst, const T* row, int c, int n) {
    constexpr int PER = 16 / sizeof(T);
    const int valid = n - c;
    const int bytes = valid >= PER ? 16 : (valid > 0 ? valid * static_cast<int>(sizeof(T)) : 0);
    cp_async16(dst, bytes ? row + c : row, bytes);
}
