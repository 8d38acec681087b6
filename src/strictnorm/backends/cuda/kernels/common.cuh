// strictnorm: element types, exact widening and rounding, and the row layout, shared by the kernels.
// Dtype codes: 0 fp32, 1 bf16, 2 fp16 (16-bit types are handled as their bit patterns).
#pragma once

template <int CODE> struct Elem;
// widen: exact to fp32; narrow: round to nearest even; bits/from_bits: the raw pattern in a 32-bit word.
template <> struct Elem<0> {
    typedef float T;
    static __device__ __forceinline__ float widen(float v) { return v; }
    static __device__ __forceinline__ unsigned int bits(float v) { return __float_as_uint(v); }
    static __device__ __forceinline__ float from_bits(unsigned int b) { return __uint_as_float(b); }
    static __device__ __forceinline__ float narrow(float v) { return v; }
};
template <> struct Elem<1> {  // bf16
    typedef unsigned short T;
    static __device__ __forceinline__ float widen(unsigned short v) {
        return __uint_as_float(static_cast<unsigned int>(v) << 16);
    }
    static __device__ __forceinline__ unsigned int bits(unsigned short v) { return v; }
    static __device__ __forceinline__ float from_bits(unsigned int b) { return __uint_as_float(b << 16); }
    static __device__ __forceinline__ unsigned short narrow(float v) {  // round to nearest even
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};
template <> struct Elem<2> {  // fp16
    typedef unsigned short T;
    static __device__ __forceinline__ float widen(unsigned short v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ unsigned int bits(unsigned short v) { return v; }
    static __device__ __forceinline__ float from_bits(unsigned int b) { return widen(static_cast<unsigned short>(b)); }
    static __device__ __forceinline__ unsigned short narrow(float v) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};

// rd(v, CODE) widened back to fp32 (exact).
template <int CODE> __device__ __forceinline__ float round_f32(float v) {
    return Elem<CODE>::widen(Elem<CODE>::narrow(v));
}

// Pairwise adjacent-first tree over WIDTH values: level by level, (2j, 2j+1) -> j. A template recursion,
// so that every index is a compile-time constant and the values stay in registers. Overwrites v.
template <int WIDTH>
__device__ __forceinline__ float pair_tree(float* v) {
    if constexpr (WIDTH == 1) {
        return v[0];
    } else {
#pragma unroll
        for (int j = 0; j < WIDTH / 2; ++j) v[j] = __fadd_rn(v[2 * j], v[2 * j + 1]);
        return pair_tree<WIDTH / 2>(v);
    }
}

// One 16-byte chunk u of elements of dtype T (code CODE) widened to fp32 into v[0 .. 16 / sizeof(T)).
template <typename T, int CODE>
__device__ __forceinline__ void widen_chunk(float* v, const uint4& u) {
    if constexpr (CODE == 1) {  // bf16 pairs widened in their 32-bit words: one shift or mask each
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[2 * j] = __uint_as_float(w[j] << 16);
            v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    } else {
        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
        for (int j = 0; j < static_cast<int>(16 / sizeof(T)); ++j) v[j] = Elem<CODE>::widen(e[j]);
    }
}

// COUNT consecutive elements at p (16-byte aligned; COUNT * sizeof(T) a multiple of 16) widened to fp32,
// through 16-byte loads (global or shared memory).
template <typename T, int CODE, int COUNT>
__device__ __forceinline__ void load_widened(float* v, const T* p) {
    constexpr int PER = 16 / sizeof(T);
    static_assert(COUNT % PER == 0, "whole 16-byte chunks");
#pragma unroll
    for (int q = 0; q < COUNT / PER; ++q) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[q];  // one 16-byte load (a reference would read elements)
        widen_chunk<T, CODE>(v + q * PER, u);
    }
}

// The normalized value as y's scaling step used it (the contract's casting modes: 0 llama, 1 gemma, 2 none),
// for a norm input of dtype code CODE: the backward's dW contributions are f32(dy) times this.
template <int CASTING, int CODE> __device__ __forceinline__ float normalized_as_used(float x, float rstd) {
    if constexpr (CASTING == 1) return __fmul_rn(x, rstd);
    else if constexpr (CASTING == 0) return round_f32<CODE>(__fmul_rn(x, rstd));
    else return round_f32<CODE>(__fmul_rn(x, round_f32<CODE>(rstd)));
}

// The contract's effective weight: f32(w) + offset in fp32, rounded to the norm input's dtype (code CODE) in
// casting mode none (2).
template <int CASTING, int CODE> __device__ __forceinline__ float effective_weight_of(float w, float offset) {
    const float v = __fadd_rn(w, offset);
    if constexpr (CASTING == 2) return round_f32<CODE>(v);
    else return v;
}

// g = f32(dy) * wf (the weight is exactly 1.0 without one: the product is dy itself).
template <bool HAS_WEIGHT> __device__ __forceinline__ float gscale(float d, float wf) {
    if constexpr (HAS_WEIGHT) {
        return __fmul_rn(d, wf);
    } else {
        (void)wf;
        return d;
    }
}

// Logical row r of a view with leading dims (R0, R1, G) and strides (s0, s1, sg); see ../../layout.py.
struct Layout {
    long long s0, s1, sg, r1, g;
};

__device__ __forceinline__ long long row_offset(long long r, const Layout& l) {
    if (r <= 0x7fffffffLL && l.g <= 0x7fffffffLL && l.r1 <= 0x7fffffffLL) {  // 32-bit divisions: far cheaper
        const unsigned int ri = static_cast<unsigned int>(r), gi = static_cast<unsigned int>(l.g);
        const unsigned int r1 = static_cast<unsigned int>(l.r1);
        const unsigned int g = ri % gi, t = ri / gi;
        return static_cast<long long>(t / r1) * l.s0 + static_cast<long long>(t % r1) * l.s1 +
               static_cast<long long>(g) * l.sg;
    }
    const long long g = r % l.g;
    const long long t = r / l.g;
    return (t / l.r1) * l.s0 + (t % l.r1) * l.s1 + g * l.sg;
}

// Programmatic dependent launch (sm_90 and newer; nothing where compiled for older GPUs or emulated). A grid
// launched after this one with programmatic stream serialization (the fast dW's partial sum after the backward)
// may be scheduled once every block of this grid has called launch_dependents, and its blocks then wait in
// wait_prerequisites until this grid has finished and its writes are visible: its launch overlaps this grid's
// tail instead of following it. Neither touches memory or changes a result.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
