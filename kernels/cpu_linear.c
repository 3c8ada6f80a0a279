/* A batch-invariant linear layer on the CPU: y = x @ w^T (+ bias), float32 and float64 (spec/batch-invariance.md
BI-1, BI-2, BI-6).

Invariant: every output y[m][n] is computed by one fixed sequence of roundings that depends on K and the layer's
chunk count alone, never on M, N, the row's position, the tile that holds it, the thread count or the instruction
set. K is cut into `chunks` equal consecutive chunks (1 for a plain layer; a row-parallel layer's TP-12 chunks);
each chunk into blocks of NVL_BLOCK consecutive k, the last one shorter; a block's sum is one chain of fused
multiply-adds (one rounding each) in increasing k starting from +0; a chunk's sum is its blocks' sums added in the
fixed pairwise order of optimized/models/sharding.py's fixed_order_sum (neighbours in pairs, level after level, an
odd last one carried up), and the layer's sum its chunks' sums added in that order too; then + bias[n]. Each output is a scalar chain, so the vector lanes hold different outputs (columns), never parts of
one sum: no horizontal reduction, and any vector width computes the same bits. The weight is packed once, when a
layer is bound (kernels/linear.py), into panels of NVT_PW columns: wp[p][k][j] = w[p * NVT_PW + j][k], the columns
past N zero. The three paths below (AVX-512; AVX2 with FMA; portable C with fmaf / fma) compute exactly these
roundings: the build picks one with -march=native. Compiled with -ffp-contract=off like cpu_attention.c: every fused
multiply-add is written out, none is left to the compiler. Every thread computes in the caller's floating-point
environment (flush-to-zero, denormals-are-zero, rounding: x86's MXCSR), which OpenMP's workers do not inherit.

x is [M, K] with row stride ldx and unit stride along K; y is [M, N] with row stride ldy. Work is split into units
of rows and panels, each computed by one thread, never along K.
*/

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if !defined(__GNUC__)
#error "cpu_linear.c is written in GNU C (always_inline): build it with GCC or Clang"
#endif
#define NVL_INLINE static inline __attribute__((always_inline))
#define NVL_UNROLL _Pragma("GCC unroll 32")

/* A block's chain of fused multiply-adds is this long; the blocks' sums are added pairwise after. */
#ifndef NVL_BLOCK
#define NVL_BLOCK 32
#endif
/* A pairwise tree kept as a binary counter of this many levels: at most 2^NVL_LEVELS - 1 parts (chunks, or blocks
   of a chunk: K up to 2^20 at NVL_BLOCK 16). */
#define NVL_LEVELS 16
/* A unit of work: up to this many rows by this many panels (a multiple of every tile width), computed by one thread. */
#define NVL_ROW_BLOCK 64
#define NVL_UNIT_PANELS 24
/* Each thread of a team gets at least this many multiply-adds (the call runs on one thread below twice this): waking
   a worker costs microseconds on an idle machine and up to a scheduler slice on a loaded one, and a single row of the
   default model's layers (65 to 393 thousand) takes tens of microseconds. How many threads run moves no bit: each
   output is computed whole by one thread, by the rule above. */
#define NVL_THREAD_WORK (1 << 20)

/* The caller's floating-point environment, set on every thread of a parallel region for its duration and the
   thread's own restored after: OpenMP's workers keep their own MXCSR, so a caller that flushes denormals
   (torch.set_flush_denormal, a library built with -ffast-math) would otherwise have the blocks on the calling
   thread rounded one way and the blocks on a worker another. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int nvl_fpenv;
NVL_INLINE nvl_fpenv nvl_fpenv_get(void) { return _mm_getcsr(); }
NVL_INLINE void nvl_fpenv_set(nvl_fpenv env) { _mm_setcsr(env); }
#else
typedef int nvl_fpenv;
NVL_INLINE nvl_fpenv nvl_fpenv_get(void) { return 0; }
NVL_INLINE void nvl_fpenv_set(nvl_fpenv env) { (void)env; }
#endif

/* How many threads a call of M * N * K multiply-adds in `units` units runs on. */
static int64_t nvl_team(int64_t threads, int64_t units, int64_t M, int64_t N, int64_t K) {
    const int64_t work = M * N * K / NVL_THREAD_WORK;
    int64_t team = threads < 1 ? 1 : threads < units ? threads : units;
    if (team > work) team = work < 1 ? 1 : work;
    return team;
}

/* 1.5 * 2^23: x + NVL_MAGIC rounds x to an integer n (to nearest, ties to even), held in the low bits. */
#define NVL_MAGIC 12582912.0f

/* One panel row is 64 bytes: 16 floats or 8 doubles, one vector of each type below. Tiles: R rows by up to
   NVL_WIDE(R) panels, as many accumulators as the path's registers hold (AVX-512: 32 registers; AVX2: 16, a vector
   taking 2); NVL_TILES lists every shape, each compiled on its own. */
#define NVL_PW32 16
#define NVL_PW64 8

#if defined(__AVX512F__)

const char *nv_linear_path(void) { return "avx512"; }
#define NVL_MAX_ROWS 8
#define NVL_MAX_ACC 24
#define NVL_WIDE(R) ((R) <= 2 ? 8 : (R) == 3 ? 6 : (R) <= 6 ? 4 : 3)
#define NVL_TILES(X)                                                                                                  \
    X(1, 1) X(1, 2) X(1, 3) X(1, 4) X(1, 5) X(1, 6) X(1, 7) X(1, 8) X(2, 1) X(2, 2) X(2, 3) X(2, 4)                   \
    X(2, 5) X(2, 6) X(2, 7) X(2, 8) X(3, 1) X(3, 2) X(3, 3) X(3, 4) X(3, 5) X(3, 6) X(4, 1) X(4, 2)                   \
    X(4, 3) X(4, 4) X(5, 1) X(5, 2) X(5, 3) X(5, 4) X(6, 1) X(6, 2) X(6, 3) X(6, 4) X(7, 1) X(7, 2)                   \
    X(7, 3) X(8, 1) X(8, 2) X(8, 3)
typedef __m512 nvl_v32;
NVL_INLINE nvl_v32 nvl_zero32(void) { return _mm512_setzero_ps(); }
NVL_INLINE nvl_v32 nvl_load32(const float *p) { return _mm512_loadu_ps(p); }
NVL_INLINE nvl_v32 nvl_broadcast32(const float *p) { return _mm512_set1_ps(*p); }
NVL_INLINE nvl_v32 nvl_fma32(nvl_v32 a, nvl_v32 b, nvl_v32 c) { return _mm512_fmadd_ps(a, b, c); }
NVL_INLINE nvl_v32 nvl_add32(nvl_v32 a, nvl_v32 b) { return _mm512_add_ps(a, b); }
NVL_INLINE void nvl_store32(float *p, nvl_v32 v) { _mm512_storeu_ps(p, v); }
NVL_INLINE nvl_v32 nvl_set32(float c) { return _mm512_set1_ps(c); }
NVL_INLINE nvl_v32 nvl_mul32(nvl_v32 a, nvl_v32 b) { return _mm512_mul_ps(a, b); }
NVL_INLINE nvl_v32 nvl_div32(nvl_v32 a, nvl_v32 b) { return _mm512_div_ps(a, b); }
NVL_INLINE nvl_v32 nvl_clamp32(nvl_v32 a, float lo, float hi) { /* NaN to lo (a NaN gate stays NaN: see silu) */
    return _mm512_min_ps(_mm512_max_ps(a, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
NVL_INLINE nvl_v32 nvl_above_inf32(nvl_v32 a, float bound, nvl_v32 v) { /* inf where a > bound, else v */
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(bound), _CMP_GT_OQ), v,
                                _mm512_set1_ps(INFINITY));
}
NVL_INLINE nvl_v32 nvl_pow2_32(nvl_v32 n) { /* 2^n for integral n in [-126, 127], n held as magic + n */
    const __m512i bits = _mm512_sub_epi32(_mm512_castps_si512(n), _mm512_castps_si512(_mm512_set1_ps(NVL_MAGIC)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(127)), 23));
}
typedef __m512d nvl_v64;
NVL_INLINE nvl_v64 nvl_zero64(void) { return _mm512_setzero_pd(); }
NVL_INLINE nvl_v64 nvl_load64(const double *p) { return _mm512_loadu_pd(p); }
NVL_INLINE nvl_v64 nvl_broadcast64(const double *p) { return _mm512_set1_pd(*p); }
NVL_INLINE nvl_v64 nvl_fma64(nvl_v64 a, nvl_v64 b, nvl_v64 c) { return _mm512_fmadd_pd(a, b, c); }
NVL_INLINE nvl_v64 nvl_add64(nvl_v64 a, nvl_v64 b) { return _mm512_add_pd(a, b); }
NVL_INLINE void nvl_store64(double *p, nvl_v64 v) { _mm512_storeu_pd(p, v); }

#elif defined(__AVX2__) && defined(__FMA__)

const char *nv_linear_path(void) { return "avx2"; }
#define NVL_MAX_ROWS 6
#define NVL_MAX_ACC 6
#define NVL_WIDE(R) ((R) <= 1 ? 3 : (R) <= 3 ? 2 : 1)
#define NVL_TILES(X) X(1, 1) X(1, 2) X(1, 3) X(2, 1) X(2, 2) X(3, 1) X(3, 2) X(4, 1) X(5, 1) X(6, 1)
typedef struct {
    __m256 lo, hi; /* columns 0..7, 8..15 of a panel */
} nvl_v32;
NVL_INLINE nvl_v32 nvl_zero32(void) { return (nvl_v32){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
NVL_INLINE nvl_v32 nvl_load32(const float *p) { return (nvl_v32){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
NVL_INLINE nvl_v32 nvl_broadcast32(const float *p) {
    const __m256 b = _mm256_broadcast_ss(p);
    return (nvl_v32){b, b};
}
NVL_INLINE nvl_v32 nvl_fma32(nvl_v32 a, nvl_v32 b, nvl_v32 c) {
    return (nvl_v32){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
NVL_INLINE nvl_v32 nvl_add32(nvl_v32 a, nvl_v32 b) {
    return (nvl_v32){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
NVL_INLINE void nvl_store32(float *p, nvl_v32 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
NVL_INLINE nvl_v32 nvl_set32(float c) { return (nvl_v32){_mm256_set1_ps(c), _mm256_set1_ps(c)}; }
NVL_INLINE nvl_v32 nvl_mul32(nvl_v32 a, nvl_v32 b) {
    return (nvl_v32){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
NVL_INLINE nvl_v32 nvl_div32(nvl_v32 a, nvl_v32 b) {
    return (nvl_v32){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
}
NVL_INLINE __m256 nvl_clamp8(__m256 a, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
NVL_INLINE nvl_v32 nvl_clamp32(nvl_v32 a, float lo, float hi) {
    return (nvl_v32){nvl_clamp8(a.lo, lo, hi), nvl_clamp8(a.hi, lo, hi)};
}
NVL_INLINE __m256 nvl_above_inf8(__m256 a, float bound, __m256 v) {
    return _mm256_blendv_ps(v, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(a, _mm256_set1_ps(bound), _CMP_GT_OQ));
}
NVL_INLINE nvl_v32 nvl_above_inf32(nvl_v32 a, float bound, nvl_v32 v) {
    return (nvl_v32){nvl_above_inf8(a.lo, bound, v.lo), nvl_above_inf8(a.hi, bound, v.hi)};
}
NVL_INLINE __m256 nvl_pow2_8(__m256 n) {
    const __m256i bits = _mm256_sub_epi32(_mm256_castps_si256(n), _mm256_castps_si256(_mm256_set1_ps(NVL_MAGIC)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(127)), 23));
}
NVL_INLINE nvl_v32 nvl_pow2_32(nvl_v32 n) { return (nvl_v32){nvl_pow2_8(n.lo), nvl_pow2_8(n.hi)}; }
typedef struct {
    __m256d lo, hi; /* columns 0..3, 4..7 of a panel */
} nvl_v64;
NVL_INLINE nvl_v64 nvl_zero64(void) { return (nvl_v64){_mm256_setzero_pd(), _mm256_setzero_pd()}; }
NVL_INLINE nvl_v64 nvl_load64(const double *p) { return (nvl_v64){_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
NVL_INLINE nvl_v64 nvl_broadcast64(const double *p) {
    const __m256d b = _mm256_broadcast_sd(p);
    return (nvl_v64){b, b};
}
NVL_INLINE nvl_v64 nvl_fma64(nvl_v64 a, nvl_v64 b, nvl_v64 c) {
    return (nvl_v64){_mm256_fmadd_pd(a.lo, b.lo, c.lo), _mm256_fmadd_pd(a.hi, b.hi, c.hi)};
}
NVL_INLINE nvl_v64 nvl_add64(nvl_v64 a, nvl_v64 b) {
    return (nvl_v64){_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)};
}
NVL_INLINE void nvl_store64(double *p, nvl_v64 v) {
    _mm256_storeu_pd(p, v.lo);
    _mm256_storeu_pd(p + 4, v.hi);
}

#else

const char *nv_linear_path(void) { return "portable"; }
#define NVL_MAX_ROWS 4
#define NVL_MAX_ACC 4
#define NVL_WIDE(R) ((R) <= 2 ? 2 : 1)
#define NVL_TILES(X) X(1, 1) X(1, 2) X(2, 1) X(2, 2) X(3, 1) X(4, 1)
typedef struct {
    float l[NVL_PW32];
} nvl_v32;
NVL_INLINE nvl_v32 nvl_zero32(void) { return (nvl_v32){{0}}; }
NVL_INLINE nvl_v32 nvl_load32(const float *p) {
    nvl_v32 v;
    for (int j = 0; j < NVL_PW32; j++) v.l[j] = p[j];
    return v;
}
NVL_INLINE nvl_v32 nvl_broadcast32(const float *p) {
    nvl_v32 v;
    for (int j = 0; j < NVL_PW32; j++) v.l[j] = *p;
    return v;
}
NVL_INLINE nvl_v32 nvl_fma32(nvl_v32 a, nvl_v32 b, nvl_v32 c) {
    for (int j = 0; j < NVL_PW32; j++) c.l[j] = fmaf(a.l[j], b.l[j], c.l[j]);
    return c;
}
NVL_INLINE nvl_v32 nvl_add32(nvl_v32 a, nvl_v32 b) {
    for (int j = 0; j < NVL_PW32; j++) a.l[j] = a.l[j] + b.l[j];
    return a;
}
NVL_INLINE void nvl_store32(float *p, nvl_v32 v) {
    for (int j = 0; j < NVL_PW32; j++) p[j] = v.l[j];
}
NVL_INLINE nvl_v32 nvl_set32(float c) { return nvl_broadcast32(&c); }
NVL_INLINE nvl_v32 nvl_mul32(nvl_v32 a, nvl_v32 b) {
    for (int j = 0; j < NVL_PW32; j++) a.l[j] = a.l[j] * b.l[j];
    return a;
}
NVL_INLINE nvl_v32 nvl_div32(nvl_v32 a, nvl_v32 b) {
    for (int j = 0; j < NVL_PW32; j++) a.l[j] = a.l[j] / b.l[j];
    return a;
}
NVL_INLINE nvl_v32 nvl_clamp32(nvl_v32 a, float lo, float hi) { /* as maxps / minps: NaN to lo */
    for (int j = 0; j < NVL_PW32; j++) {
        const float m = a.l[j] > lo ? a.l[j] : lo;
        a.l[j] = m < hi ? m : hi;
    }
    return a;
}
NVL_INLINE nvl_v32 nvl_above_inf32(nvl_v32 a, float bound, nvl_v32 v) {
    for (int j = 0; j < NVL_PW32; j++)
        if (a.l[j] > bound) v.l[j] = INFINITY;
    return v;
}
NVL_INLINE nvl_v32 nvl_pow2_32(nvl_v32 n) {
    const float magic = NVL_MAGIC;
    uint32_t m;
    memcpy(&m, &magic, 4);
    for (int j = 0; j < NVL_PW32; j++) {
        uint32_t b;
        memcpy(&b, &n.l[j], 4);
        b = ((b - m) + 127u) << 23;
        memcpy(&n.l[j], &b, 4);
    }
    return n;
}
typedef struct {
    double l[NVL_PW64];
} nvl_v64;
NVL_INLINE nvl_v64 nvl_zero64(void) { return (nvl_v64){{0}}; }
NVL_INLINE nvl_v64 nvl_load64(const double *p) {
    nvl_v64 v;
    for (int j = 0; j < NVL_PW64; j++) v.l[j] = p[j];
    return v;
}
NVL_INLINE nvl_v64 nvl_broadcast64(const double *p) {
    nvl_v64 v;
    for (int j = 0; j < NVL_PW64; j++) v.l[j] = *p;
    return v;
}
NVL_INLINE nvl_v64 nvl_fma64(nvl_v64 a, nvl_v64 b, nvl_v64 c) {
    for (int j = 0; j < NVL_PW64; j++) c.l[j] = fma(a.l[j], b.l[j], c.l[j]);
    return c;
}
NVL_INLINE nvl_v64 nvl_add64(nvl_v64 a, nvl_v64 b) {
    for (int j = 0; j < NVL_PW64; j++) a.l[j] = a.l[j] + b.l[j];
    return a;
}
NVL_INLINE void nvl_store64(double *p, nvl_v64 v) {
    for (int j = 0; j < NVL_PW64; j++) p[j] = v.l[j];
}

#endif

/* float32: nv_linear_f32 and its helpers. */
#define NVT_T float
#define NVT_V nvl_v32
#define NVT_PW NVL_PW32
#define NVT_NAME(name) nvl32_##name
#define nvt_zero nvl_zero32
#define nvt_load nvl_load32
#define nvt_broadcast nvl_broadcast32
#define nvt_fma nvl_fma32
#define nvt_add nvl_add32
#define nvt_store nvl_store32
#define nvl32_linear nv_linear_f32
#include "cpu_linear_tile.h"
#undef NVT_T
#undef NVT_V
#undef NVT_PW
#undef NVT_NAME
#undef nvt_zero
#undef nvt_load
#undef nvt_broadcast
#undef nvt_fma
#undef nvt_add
#undef nvt_store

/* float64: the same rule in double (MKL's dgemm is M-dependent as its sgemm is: BI-6). */
#define NVT_T double
#define NVT_V nvl_v64
#define NVT_PW NVL_PW64
#define NVT_NAME(name) nvl64_##name
#define nvt_zero nvl_zero64
#define nvt_load nvl_load64
#define nvt_broadcast nvl_broadcast64
#define nvt_fma nvl_fma64
#define nvt_add nvl_add64
#define nvt_store nvl_store64
#define nvl64_linear nv_linear_f64
#include "cpu_linear_tile.h"

/* The MLP's activation in the batch-invariant mode (spec/batch-invariance.md BI-8): out[m][i] = g / (1 + e^-g) * u for
g = gu[m][i], u = gu[m][I + i]. Every element, wherever it sits, goes through the same vector code (the last
elements of a row through a zero-padded copy), whose every step is one IEEE operation rounded to nearest, so the
three paths give the same bits and a row's bits do not depend on its batch or on the thread count (torch's F.silu
computes the elements past a thread's last whole vector with another exp). e^t is Cephes' expf (within 2 units in
the last place of the correctly rounded SiLU, as torch's exp): t clamped to [-87, 88.37], n = round(t / ln 2),
r = t - n ln 2 in two fused steps, a degree-7 polynomial, times 2^n; below -87, 1 + e^t is 1 all the same; above
88.37, e^t is taken as inf (it is finite up to 88.72, so g in [-88.72, -88.37) gives -0, not about -3e-37). */
NVL_INLINE nvl_v32 nvl_silu_mul(nvl_v32 g, nvl_v32 u) {
    const nvl_v32 t = nvl_clamp32(nvl_mul32(g, nvl_set32(-1.0f)), -87.0f, 88.37f);
    const nvl_v32 n = nvl_add32(nvl_mul32(t, nvl_set32(1.44269504088896341f)), nvl_set32(NVL_MAGIC));
    const nvl_v32 nf = nvl_add32(n, nvl_set32(-NVL_MAGIC));
    nvl_v32 r = nvl_fma32(nf, nvl_set32(-0.693359375f), t);
    r = nvl_fma32(nf, nvl_set32(2.12194440e-4f), r);
    nvl_v32 p = nvl_set32(1.9875691500e-4f);
    p = nvl_fma32(p, r, nvl_set32(1.3981999507e-3f));
    p = nvl_fma32(p, r, nvl_set32(8.3334519073e-3f));
    p = nvl_fma32(p, r, nvl_set32(4.1665795894e-2f));
    p = nvl_fma32(p, r, nvl_set32(1.6666665459e-1f));
    p = nvl_fma32(p, r, nvl_set32(5.0000001201e-1f));
    p = nvl_fma32(p, nvl_mul32(r, r), r);
    p = nvl_add32(p, nvl_set32(1.0f));
    const nvl_v32 e = nvl_above_inf32(nvl_mul32(g, nvl_set32(-1.0f)), 88.37f, nvl_mul32(p, nvl_pow2_32(n)));
    return nvl_mul32(nvl_div32(g, nvl_add32(nvl_set32(1.0f), e)), u);
}

#define NVL_ACT_WORK (1 << 15) /* elements a thread gets at least */

void nv_silu_mul_f32(const float *gu, int64_t ldgu, float *out, int64_t ldo, int64_t M, int64_t I, int64_t threads) {
    if (M <= 0 || I <= 0) return;
    int64_t team = threads < 1 ? 1 : threads < M ? threads : M;
    if (team > M * I / NVL_ACT_WORK) team = M * I / NVL_ACT_WORK < 1 ? 1 : M * I / NVL_ACT_WORK;
    const nvl_fpenv env = nvl_fpenv_get();
#pragma omp parallel for num_threads((int)team) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const nvl_fpenv own = nvl_fpenv_get();
        nvl_fpenv_set(env);
        const float *g = gu + m * ldgu, *u = g + I;
        float *o = out + m * ldo;
        int64_t i = 0;
        for (; i + NVL_PW32 <= I; i += NVL_PW32) nvl_store32(o + i, nvl_silu_mul(nvl_load32(g + i), nvl_load32(u + i)));
        if (i < I) {
            float gt[NVL_PW32] = {0}, ut[NVL_PW32] = {0}, ot[NVL_PW32];
            memcpy(gt, g + i, (size_t)(I - i) * sizeof(float));
            memcpy(ut, u + i, (size_t)(I - i) * sizeof(float));
            nvl_store32(ot, nvl_silu_mul(nvl_load32(gt), nvl_load32(ut)));
            memcpy(o + i, ot, (size_t)(I - i) * sizeof(float));
        }
        nvl_fpenv_set(own);
    }
}
