/* A batch-invariant linear layer on the CPU: y = x @ w^T (+ bias), float32 (spec/batch-invariance.md BI-1, BI-2).

Invariant: every output y[m][n] is computed by one fixed sequence of roundings that depends on K alone, never on M,
N, the row's position, the tile that holds it, the thread count or the instruction set: 16 lanes, lane l taking
k = l, l + 16, l + 32, ... in increasing k, each step one fused multiply-add (one rounding) starting from +0; when
K is not a multiple of 16, the last chunk's lanes past K take one more step, fma(0, 0, acc) (which turns an
accumulator of -0, left by a product that underflowed, into +0: zero-padding, as the emulation in linear.py pads);
then the lanes added in a fixed halving tree (lane l + lane l + 8, then + 4, + 2, + 1); then + bias[n]. The three
paths below (AVX-512, AVX2 with FMA, portable C with fmaf) compute exactly these roundings: the build picks one with
-march=native; float64 follows the same rule with fma(). Compiled with -ffp-contract=off like cpu_attention.c: every
fused multiply-add is written out, none is left to the compiler. Every thread computes in the caller's floating-point
environment (flush-to-zero, denormals-are-zero, rounding: x86's MXCSR), which OpenMP's workers do not inherit.

x is [M, K] with row stride ldx, w is [N, K] with row stride ldw (torch's Linear weight), both with unit stride
along K; y is [M, N] with row stride ldy. Work is split into blocks of rows and columns, each block computed by one
thread, never along K.
*/

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if !defined(__GNUC__)
#error "cpu_linear.c is written in GNU C (always_inline): build it with GCC or Clang"
#endif
#define NVL_INLINE static inline __attribute__((always_inline))

#define NVL_LANES 16
/* A unit of work: this many rows by this many columns, computed by one thread (multiples of 4 and 16). */
#define NVL_ROW_BLOCK 64
#define NVL_COL_BLOCK 64
/* Each thread of a team gets at least this many multiply-adds (the call runs on one thread below twice this): waking
   a worker costs microseconds on an idle machine and up to a scheduler slice on a loaded one, and a single row of the
   default model's layers (65 to 200 thousand) takes tens of microseconds. How many threads run moves no bit: each
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

/* How many threads a call of M * N * K multiply-adds in `units` blocks runs on. */
static int64_t nvl_team(int64_t threads, int64_t units, int64_t M, int64_t N, int64_t K) {
    const int64_t work = M * N * K / NVL_THREAD_WORK;
    int64_t team = threads < 1 ? 1 : threads < units ? threads : units;
    if (team > work) team = work < 1 ? 1 : work;
    return team;
}

#if defined(__AVX512F__)

const char *nv_linear_path(void) { return "avx512"; }
typedef __m512 nvl_vec;
NVL_INLINE nvl_vec nvl_zero(void) { return _mm512_setzero_ps(); }
NVL_INLINE nvl_vec nvl_load(const float *p) { return _mm512_loadu_ps(p); }
NVL_INLINE nvl_vec nvl_load_first(const float *p, int64_t r) { /* lanes r.. are 0 */
    return _mm512_maskz_loadu_ps((__mmask16)((1u << r) - 1u), p);
}
NVL_INLINE nvl_vec nvl_fma(nvl_vec a, nvl_vec b, nvl_vec acc) { return _mm512_fmadd_ps(a, b, acc); }
NVL_INLINE float nvl_sum(nvl_vec v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#elif defined(__AVX2__) && defined(__FMA__)

const char *nv_linear_path(void) { return "avx2"; }
typedef struct {
    __m256 lo, hi; /* lanes 0..7, 8..15 */
} nvl_vec;
NVL_INLINE nvl_vec nvl_zero(void) { return (nvl_vec){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
NVL_INLINE nvl_vec nvl_load(const float *p) { return (nvl_vec){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
NVL_INLINE __m256i nvl_mask8(int64_t r) { /* all ones in lanes < r */
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), index);
}
NVL_INLINE nvl_vec nvl_load_first(const float *p, int64_t r) { /* lanes r.. are 0, never read */
    const __m256 lo = _mm256_maskload_ps(p, nvl_mask8(r));
    const __m256 hi = r > 8 ? _mm256_maskload_ps(p + 8, nvl_mask8(r - 8)) : _mm256_setzero_ps();
    return (nvl_vec){lo, hi};
}
NVL_INLINE nvl_vec nvl_fma(nvl_vec a, nvl_vec b, nvl_vec acc) {
    return (nvl_vec){_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
}
NVL_INLINE float nvl_sum(nvl_vec v) {
    const __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#else

const char *nv_linear_path(void) { return "portable"; }
typedef struct {
    float l[NVL_LANES];
} nvl_vec;
NVL_INLINE nvl_vec nvl_zero(void) { return (nvl_vec){{0}}; }
NVL_INLINE nvl_vec nvl_load(const float *p) {
    nvl_vec v;
    for (int l = 0; l < NVL_LANES; l++) v.l[l] = p[l];
    return v;
}
NVL_INLINE nvl_vec nvl_load_first(const float *p, int64_t r) {
    nvl_vec v = {{0}};
    for (int l = 0; l < r; l++) v.l[l] = p[l];
    return v;
}
NVL_INLINE nvl_vec nvl_fma(nvl_vec a, nvl_vec b, nvl_vec acc) {
    for (int l = 0; l < NVL_LANES; l++) acc.l[l] = fmaf(a.l[l], b.l[l], acc.l[l]);
    return acc;
}
NVL_INLINE float nvl_sum(nvl_vec v) {
    for (int w = NVL_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) v.l[l] = v.l[l] + v.l[l + w];
    return v.l[0];
}

#endif

#if defined(__AVX512F__)
/* Sixteen accumulators reduced together, each by the halving tree of nvl_sum (the same additions of the same
   lanes, so the same bits), with a quarter of the shuffles: lane L of the result is the sum of v[4 * (L % 4) + L / 4].
   Pairs first add their 8-lane halves (quarters 0-1 and 2-3 of both), then 4-lane quarters, then the lanes 2
   apart and 1 apart inside each quarter. */
NVL_INLINE __m512 nvl_sum16(const nvl_vec v[16]) {
    __m512 u[8], w[4], x[2];
    for (int p = 0; p < 8; p++)
        u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++)
        w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * r], u[2 * r + 1], 0xDD));
    for (int r = 0; r < 2; r++)
        x[r] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * r], w[2 * r + 1], 0x44),
                             _mm512_shuffle_ps(w[2 * r], w[2 * r + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
}
#endif

/* The outputs of rows x[0 .. R) by weight rows w[0 .. C), R * C <= 16, both known at compile time where it is
   inlined, so the accumulators stay in registers: acc[i * C + j] is y[i][j]. */
NVL_INLINE void nvl_tile(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                         int64_t ldy, int64_t K, const int R, const int C) {
    nvl_vec acc[16];
    for (int a = 0; a < R * C; a++) acc[a] = nvl_zero();
    int64_t k = 0;
    for (; k + NVL_LANES <= K; k += NVL_LANES) {
        nvl_vec xv[16], wv[16];
        for (int i = 0; i < R; i++) xv[i] = nvl_load(x + i * ldx + k);
        for (int j = 0; j < C; j++) wv[j] = nvl_load(w + j * ldw + k);
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++) acc[i * C + j] = nvl_fma(xv[i], wv[j], acc[i * C + j]);
    }
    if (k < K) {
        nvl_vec xv[16], wv[16];
        for (int i = 0; i < R; i++) xv[i] = nvl_load_first(x + i * ldx + k, K - k);
        for (int j = 0; j < C; j++) wv[j] = nvl_load_first(w + j * ldw + k, K - k);
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++) acc[i * C + j] = nvl_fma(xv[i], wv[j], acc[i * C + j]);
    }
    float s[16];
#if defined(__AVX512F__)
    if (R * C > 4) {
        nvl_vec v[16];
        for (int a = 0; a < 16; a++) v[a] = 4 * (a % 4) + a / 4 < R * C ? acc[4 * (a % 4) + a / 4] : nvl_zero();
        _mm512_storeu_ps(s, nvl_sum16(v));
    } else
#endif
        for (int a = 0; a < R * C; a++) s[a] = nvl_sum(acc[a]);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) y[i * ldy + j] = bias != NULL ? s[i * C + j] + bias[j] : s[i * C + j];
}

/* A tile of r <= 4 rows by c <= 4 columns, each size its own inlined copy (the edges of a block). */
static void nvl_tile_any(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                         int64_t ldy, int64_t K, int r, int c) {
#define NVL_CASE(a, b)                                                                                                \
    case (a) * 8 + (b):                                                                                               \
        nvl_tile(x, ldx, w, ldw, bias, y, ldy, K, a, b);                                                             \
        break;
    switch (r * 8 + c) {
        NVL_CASE(1, 1) NVL_CASE(1, 2) NVL_CASE(1, 3) NVL_CASE(1, 4)
        NVL_CASE(2, 1) NVL_CASE(2, 2) NVL_CASE(2, 3) NVL_CASE(2, 4)
        NVL_CASE(3, 1) NVL_CASE(3, 2) NVL_CASE(3, 3) NVL_CASE(3, 4)
        NVL_CASE(4, 1) NVL_CASE(4, 2) NVL_CASE(4, 3) NVL_CASE(4, 4)
    default:
        break;
    }
#undef NVL_CASE
}

/* Rows m0 .. m0 + R by columns n0 .. n1: whole R x C tiles, then the last columns in tiles of 4 or fewer. */
NVL_INLINE void nvl_row_group(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                              int64_t ldy, int64_t K, int64_t n0, int64_t n1, const int R, const int C) {
    int64_t n = n0;
    for (; n + C <= n1; n += C)
        nvl_tile(x, ldx, w + n * ldw, ldw, bias != NULL ? bias + n : NULL, y + n, ldy, K, R, C);
    for (; n < n1; n += 4) {
        const int c = (int)(n1 - n < 4 ? n1 - n : 4);
        nvl_tile_any(x, ldx, w + n * ldw, ldw, bias != NULL ? bias + n : NULL, y + n, ldy, K, R, c);
    }
}

/* The split both precisions share: units of NVL_ROW_BLOCK rows by NVL_COL_BLOCK columns, column blocks outer (a
   block of weight rows is reused by every row block a thread takes); unit u covers rows [m0, m1), columns [n0, n1).
   The split never reaches K, so it moves no bit. */
typedef struct {
    int64_t m0, m1, n0, n1;
} nvl_unit;

NVL_INLINE nvl_unit nvl_unit_of(int64_t u, int64_t row_blocks, int64_t M, int64_t N) {
    nvl_unit b;
    b.n0 = u / row_blocks * NVL_COL_BLOCK;
    b.m0 = u % row_blocks * NVL_ROW_BLOCK;
    b.n1 = b.n0 + NVL_COL_BLOCK < N ? b.n0 + NVL_COL_BLOCK : N;
    b.m1 = b.m0 + NVL_ROW_BLOCK < M ? b.m0 + NVL_ROW_BLOCK : M;
    return b;
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N] when bias is not NULL) on up to `threads` threads. */
void nv_linear_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t row_blocks = (M + NVL_ROW_BLOCK - 1) / NVL_ROW_BLOCK;
    const int64_t col_blocks = (N + NVL_COL_BLOCK - 1) / NVL_COL_BLOCK;
    const int64_t units = row_blocks * col_blocks;
    const int64_t team = nvl_team(threads, units, M, N, K);
    const nvl_fpenv env = nvl_fpenv_get();
#pragma omp parallel num_threads((int)team)
    {
        const nvl_fpenv own = nvl_fpenv_get();
        nvl_fpenv_set(env);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const nvl_unit b = nvl_unit_of(u, row_blocks, M, N);
            const int64_t n0 = b.n0, n1 = b.n1, m1 = b.m1;
            int64_t m = b.m0;
            for (; m + 4 <= m1; m += 4)
                nvl_row_group(x + m * ldx, ldx, w, ldw, bias, y + m * ldy, ldy, K, n0, n1, 4, 4);
            /* The last rows: wider tiles, so each still keeps up to 16 accumulators busy. */
            if (m1 - m == 3) nvl_row_group(x + m * ldx, ldx, w, ldw, bias, y + m * ldy, ldy, K, n0, n1, 3, 4);
            if (m1 - m == 2) nvl_row_group(x + m * ldx, ldx, w, ldw, bias, y + m * ldy, ldy, K, n0, n1, 2, 8);
            if (m1 - m == 1) nvl_row_group(x + m * ldx, ldx, w, ldw, bias, y + m * ldy, ldy, K, n0, n1, 1, 16);
        }
        nvl_fpenv_set(own);
    }
}

/* float64: the same rule in double (16 lanes of fused multiply-adds over k = l, l + 16, ... from +0, the last
   chunk's lanes past K taking fma(0, 0, acc) as in float32, the halving tree, then + bias[n]), each lane written as C's fma(), which the compiler turns into vector fused multiply-adds
   where the target has them (one rounding each, as the standard requires, so any width gives the same bits). MKL's
   dgemm is M-dependent as its sgemm is (spec/batch-invariance.md, BI-6). */

NVL_INLINE void nvl_tile_f64(const double *x, int64_t ldx, const double *w, int64_t ldw, const double *bias,
                             double *y, int64_t ldy, int64_t K, const int R, const int C) {
    double acc[4][4][NVL_LANES];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++)
            for (int l = 0; l < NVL_LANES; l++) acc[i][j][l] = 0.0;
    int64_t k = 0;
    for (; k + NVL_LANES <= K; k += NVL_LANES)
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++)
                for (int l = 0; l < NVL_LANES; l++)
                    acc[i][j][l] = fma(x[i * ldx + k + l], w[j * ldw + k + l], acc[i][j][l]);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            double *a = acc[i][j];
            if (k < K)
                for (int l = 0; l < NVL_LANES; l++) {
                    const int in = l < K - k;
                    a[l] = fma(in ? x[i * ldx + k + l] : 0.0, in ? w[j * ldw + k + l] : 0.0, a[l]);
                }
            for (int width = NVL_LANES / 2; width > 0; width /= 2)
                for (int l = 0; l < width; l++) a[l] = a[l] + a[l + width];
            y[i * ldy + j] = bias != NULL ? a[0] + bias[j] : a[0];
        }
}

static void nvl_tile_any_f64(const double *x, int64_t ldx, const double *w, int64_t ldw, const double *bias,
                             double *y, int64_t ldy, int64_t K, int r, int c) {
#define NVL_CASE64(a, b)                                                                                              \
    case (a) * 8 + (b):                                                                                               \
        nvl_tile_f64(x, ldx, w, ldw, bias, y, ldy, K, a, b);                                                         \
        break;
    switch (r * 8 + c) {
        NVL_CASE64(1, 1) NVL_CASE64(1, 2) NVL_CASE64(1, 3) NVL_CASE64(1, 4)
        NVL_CASE64(2, 1) NVL_CASE64(2, 2) NVL_CASE64(2, 3) NVL_CASE64(2, 4)
    default:
        break;
    }
#undef NVL_CASE64
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float64: tiles of 2 rows by 4 columns, blocks split as above. */
void nv_linear_f64(const double *x, int64_t ldx, const double *w, int64_t ldw, const double *bias, double *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t threads) {
    if (M <= 0 || N <= 0) return;
    const int64_t row_blocks = (M + NVL_ROW_BLOCK - 1) / NVL_ROW_BLOCK;
    const int64_t col_blocks = (N + NVL_COL_BLOCK - 1) / NVL_COL_BLOCK;
    const int64_t units = row_blocks * col_blocks;
    const int64_t team = nvl_team(threads, units, M, N, K);
    const nvl_fpenv env = nvl_fpenv_get();
#pragma omp parallel num_threads((int)team)
    {
        const nvl_fpenv own = nvl_fpenv_get();
        nvl_fpenv_set(env);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const nvl_unit blk = nvl_unit_of(u, row_blocks, M, N);
            const int64_t n0 = blk.n0, n1 = blk.n1, m1 = blk.m1;
            for (int64_t m = blk.m0; m < m1; m += 2) {
                const int r = m1 - m < 2 ? 1 : 2;
                for (int64_t n = n0; n < n1; n += 4) {
                    const int c = (int)(n1 - n < 4 ? n1 - n : 4);
                    const double *b = bias != NULL ? bias + n : NULL;
                    if (r == 2 && c == 4)
                        nvl_tile_f64(x + m * ldx, ldx, w + n * ldw, ldw, b, y + m * ldy + n, ldy, K, 2, 4);
                    else
                        nvl_tile_any_f64(x + m * ldx, ldx, w + n * ldw, ldw, b, y + m * ldy + n, ldy, K, r, c);
                }
            }
        }
        nvl_fpenv_set(own);
    }
}
