// CPU emulation of the CUDA features rms_norm.cu, fold.cu and onepass.cu use (bench/emulate/run.sh, fold_run.sh,
// onepass_run.sh): one std::thread per CUDA thread, a CTA's barriers (the block's, each warp's, named ones,
// mbarriers), shuffle buffer and dynamic shared memory in an EmuBlock its
// threads point at (so CTAs may run one after another or all at once), fp32 operations as the C++ operators
// (built with -ffp-contract=off), bf16 rounding to nearest even on the bit pattern. Built with
// AddressSanitizer, it reports any read or write outside the buffers a kernel is given. Static __shared__
// arrays (rms_norm.cu's) are one per process: such kernels run one CTA at a time.
#pragma once
#include <barrier>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <map>
#include <mutex>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
struct dim3e { unsigned x, y, z; };
inline thread_local dim3e threadIdx{0, 0, 0};
inline thread_local dim3e blockIdx{0, 0, 0};
inline dim3e gridDim{1, 1, 1};
inline dim3e blockDim{1, 1, 1};

// One CTA's emulated state: its barrier, a barrier and a shuffle buffer per warp, its dynamic shared memory.
struct EmuBlock {
    std::barrier<> block;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    float warp_buf[32][32];
    std::mutex named_mutex;
    std::unique_ptr<std::barrier<>> named[16];
    struct Mbar { int count = 0, pending = 0; unsigned phase = 0; };
    std::mutex mbar_mutex;
    std::map<const void*, Mbar> mbars;  // the shared-memory barriers, by address
    unsigned char* smem;
    EmuBlock(int threads, long long smem_bytes)
        : block(threads), smem(static_cast<unsigned char*>(aligned_alloc(16, smem_bytes > 0 ? (smem_bytes + 15) / 16 * 16 : 16))) {
        for (int i = 0; i < threads / 32; ++i) warps.push_back(std::make_unique<std::barrier<>>(32));
    }
    ~EmuBlock() { free(smem); }
};
inline thread_local EmuBlock* g_block = nullptr;
inline thread_local unsigned char* g_dynamic_smem = nullptr;  // g_block->smem (fold_run.sh's sed names it)
// Sets the calling thread's place: thread t of CTA bx, whose state is blk.
inline void emu_enter(EmuBlock& blk, unsigned bx, int t) {
    threadIdx.x = t;
    blockIdx = {bx, 0, 0};
    g_block = &blk;
    g_dynamic_smem = blk.smem;
}
inline void __syncthreads() { g_block->block.arrive_and_wait(); }
inline void __syncwarp() { g_block->warps[threadIdx.x / 32]->arrive_and_wait(); }
// bar.sync id, threads: a barrier per id, made by the first thread to reach it (every caller passes the same count)
inline void named_barrier(int id, int threads) {
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> lock(g_block->named_mutex);
        auto& slot = g_block->named[id];
        if (!slot) slot = std::make_unique<std::barrier<>>(threads);
        b = slot.get();
    }
    b->arrive_and_wait();
}
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_block->warp_buf[w][l] = v;
    g_block->warps[w]->arrive_and_wait();
    float r = g_block->warp_buf[w][l ^ off];
    g_block->warps[w]->arrive_and_wait();
    return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    g_block->warp_buf[w][l] = v;
    g_block->warps[w]->arrive_and_wait();
    float r = g_block->warp_buf[w][src];
    g_block->warps[w]->arrive_and_wait();
    return r;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
using std::max; using std::min;
inline unsigned short emu_bf16_rn(float v) {
    unsigned b = __float_as_uint(v);
    if (std::isnan(v)) return 0x7fc0;
    return static_cast<unsigned short>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

// fold.cu (bench/emulate/fold_main.cpp): dynamic shared memory, 16-byte vectors, and cp.async as a copy made
// at once (the bytes past `bytes` zero-filled, as cp.async does); the commit and wait calls have nothing
// left to do. Stronger than the GPU's ordering: it checks the ring's indexing and bounds, not its waits.
#define __align__(x) alignas(x)
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline void cp_async16(void* smem, const void* gmem, int bytes) {
    std::memset(smem, 0, 16);
    if (bytes) std::memcpy(smem, gmem, bytes);
}
inline void cp_async4(void* smem, const void* gmem) { std::memcpy(smem, gmem, 4); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}

// fold_chain: the item counter and the hand-over words.
#include <atomic>
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned long long load_acquire64(const unsigned long long* p) {
    std::this_thread::yield();  // called in spin loops: let the threads that will hand over run
    return std::atomic_ref<unsigned long long>(*const_cast<unsigned long long*>(p)).load(std::memory_order_acquire);
}
inline void store_release64(unsigned long long* p, unsigned long long v) {
    std::atomic_ref<unsigned long long>(*p).store(v, std::memory_order_release);
}

// onepass.cu: arrival counters polled with acquire loads and raised with release, loads that bypass L1,
// shared-memory barriers with phases.
inline int load_acquire(const int* p) {
    std::this_thread::yield();  // called in spin loops
    return std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire);
}
// Random short pauses around the hand-overs (before an arrival, after a wait), so that the emulated warps drift
// apart as far as the protocol lets them (a missing wait then shows as wrong bits or a lost phase, not only
// under lucky timing).
inline void emu_jitter() {
    thread_local unsigned state = 0x9e3779b9u ^ (threadIdx.x * 2654435761u) ^ (blockIdx.x * 40503u);
    state = state * 1664525u + 1013904223u;
    if ((state >> 28) < 2) std::this_thread::sleep_for(std::chrono::microseconds((state >> 8) % 3000));
}

// mbarrier: a phase completes when `count` arrivals have come; test_wait.parity p is true once the current
// phase's parity differs from p (the phase with parity p, the current one or the one before, completed).
inline void mbar_init(unsigned long long* bar, int count) {
    std::lock_guard<std::mutex> lock(g_block->mbar_mutex);
    g_block->mbars[bar] = EmuBlock::Mbar{count, count, 0};
}
inline void mbar_arrive(unsigned long long* bar) {
    emu_jitter();
    std::lock_guard<std::mutex> lock(g_block->mbar_mutex);
    auto& b = g_block->mbars.at(bar);
    if (--b.pending == 0) b.pending = b.count, ++b.phase;
}
inline void mbar_wait(unsigned long long* bar, int parity) {
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        {
            std::lock_guard<std::mutex> lock(g_block->mbar_mutex);
            if (static_cast<int>(g_block->mbars.at(bar).phase & 1u) != parity) break;
        }
        if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {  // a lost phase: fail, not hang
            fprintf(stderr, "ERROR: mbarrier wait past 60 s (block %u, thread %u)\n", blockIdx.x, threadIdx.x);
            std::abort();
        }
        std::this_thread::yield();
    }
    emu_jitter();
}
inline bool mbar_test(unsigned long long* bar, int parity) {
    emu_jitter();
    std::lock_guard<std::mutex> lock(g_block->mbar_mutex);
    return static_cast<int>(g_block->mbars.at(bar).phase & 1u) != parity;
}
inline void add_release(int* p, int v) { std::atomic_ref<int>(*p).fetch_add(v, std::memory_order_release); }
inline unsigned long long global_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
[[noreturn]] inline void __trap() { std::abort(); }
template <typename T> inline T __ldcg(const T* p) { return *p; }
