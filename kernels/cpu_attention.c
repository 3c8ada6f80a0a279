/* Paged attention on the CPU, reading the paged cache in place: decode (spec/kernels.md KERN-22) and causal prefill
(KERN-27, which copies one sequence's keys of one KV head at a time into a transposed per-thread buffer). A prefill
query's row is the decode's for the same query and keys, bit for bit (spec/batch-invariance.md BI-4).

Invariants: the caches are [num_blocks, block_size, kvh, d] and contiguous; q is [rows, h, d] with any row and head
strides but unit stride inside a head; out is [rows, h, d] and contiguous. Sequence b's context is the first
context_lens[b] slots named by its block-table row (stride `width`), every one of which must name a block in [0,
num_blocks): tables (and, for prefill, query counts) are checked before anything is written, and a bad row is
reported, never read. Query head g uses KV head g / (h / kvh). All arithmetic is in the element type T (float or
double) with IEEE semantics: no -ffast-math, no contraction into fused multiply-adds (-ffp-contract=off), sums in an
order fixed by this source, an exponential of our own (nv_exp_*, no libm), so the result does not depend on the
machine's vector width. A row with context 0 outputs zeros. Sequences are independent and each (row or sequence, KV
head) is computed by one thread, so results do not depend on the thread count either; each thread keeps its own
buffers and computes in the caller's floating-point environment (x86's MXCSR: flush-to-zero, denormals-are-zero),
which OpenMP's workers do not inherit.

The bodies below are written once for a type T and instantiated for float and double by including this file into
itself (the C way to write a function template); they are GNU C (vector extensions, always_inline, prefetch).
*/

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef NV_T

/* A fixed count of partial sums per dot product: the compiler maps them onto vector lanes without reordering any
   sum (which IEEE semantics forbid it to do itself), and the result does not depend on the machine's vector width. */
#define NV_LANES 16 /* the halving tree in dot() is written for 16 */
/* Elements of type float per 64-byte cache line; prefetching every this many elements of a double row touches
   each line at least once too (twice, harmlessly). */
#define NV_LINE 16
/* Prefill scores this many query vectors together against each block of transposed keys, so the block is read
   from cache once per tile rather than from memory once per vector. */
#define NV_TILE 16
/* Bytes per vector of the prefill's key and value tiles: the target's widest. No bit depends on it (each lane is
   another key or output element), which tests check by building the file for each. */
#if defined(__AVX512F__)
#define NV_VBYTES 64
#elif defined(__AVX__)
#define NV_VBYTES 32
#else
#define NV_VBYTES 16
#endif
/* Register blocking of the prefill: NV_SQ query vectors score a block of keys together (each key row loaded once
   for all), and NV_VQ vectors times NV_VCH vectors of output elements sum V in registers (fewer vectors where the
   target has 16 vector registers rather than 32). */
#define NV_SQ 4
#define NV_VQ (NV_VBYTES == 64 ? 4 : 2)
#define NV_VCH 4

#if !defined(__GNUC__)
#error "cpu_attention.c is written in GNU C (vector extensions, always_inline, prefetch): build it with GCC or Clang"
#endif
#define NV_INLINE inline __attribute__((always_inline))
#define nv_prefetch(p) __builtin_prefetch((p), 0, 3)

/* The caller's floating-point environment, set on every thread of a parallel region for its duration and the
   thread's own restored after: OpenMP's workers keep their own MXCSR, so a caller that flushes denormals
   (torch.set_flush_denormal, a library built with -ffast-math) would otherwise have the rows on the calling thread
   rounded one way and the rows on a worker another. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int nv_fpenv;
static NV_INLINE nv_fpenv nv_fpenv_get(void) { return _mm_getcsr(); }
static NV_INLINE void nv_fpenv_set(nv_fpenv env) { _mm_setcsr(env); }
#else
typedef int nv_fpenv;
static NV_INLINE nv_fpenv nv_fpenv_get(void) { return 0; }
static NV_INLINE void nv_fpenv_set(nv_fpenv env) { (void)env; }
#endif

/* 0 when every row's context fits its table row and names existing blocks only, else 1 + the first bad row;
   *max_len gets the longest context. */
static int64_t nv_check_tables(const int32_t *context_lens, const int32_t *block_tables, int64_t batch,
                               int64_t width, int64_t block_size, int64_t num_blocks, int64_t *max_len) {
    *max_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t n = context_lens[b];
        if (n < 0 || n > width * block_size) return b + 1;
        for (int64_t c = 0; c * block_size < n; c++) {
            int64_t id = block_tables[b * width + c];
            if (id < 0 || id >= num_blocks) return b + 1;
        }
        if (n > *max_len) *max_len = n;
    }
    return 0;
}

/* 0 when sequence b's packed queries cu_seqlens[b] .. cu_seqlens[b + 1] - 1 number between 0 and its context length
   (and cu_seqlens starts at 0), else 1 + the first bad sequence. */
static int64_t nv_check_queries(const int32_t *cu_seqlens, const int32_t *context_lens, int64_t batch) {
    if (batch > 0 && cu_seqlens[0] != 0) return 1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t qlen = (int64_t)cu_seqlens[b + 1] - cu_seqlens[b];
        if (qlen < 0 || qlen > context_lens[b]) return b + 1;
    }
    return 0;
}

/* How many chunks of KV heads each row is cut into, so that a batch of fewer rows than threads still has work
   for every thread. */
static int64_t nv_head_chunks(int64_t batch, int64_t kv_heads, int64_t threads) {
    if (batch >= threads) return 1;
    int64_t chunks = (threads + batch - 1) / batch;
    return chunks < kv_heads ? chunks : kv_heads;
}

/* exp(x) in plain arithmetic, so that the softmax loop vectorises (a libm call per element would not, without
   -ffast-math): x = k ln2 + r with |r| <= ln2 / 2 (k rounded by adding 1.5 * 2^m, ln2 split in two so that k times
   its high part is exact), e^r by its Taylor polynomial (degree 7 for float, 13 for double: the first omitted term
   is under 0.05 ulp), times 2^k built in the exponent bits. Within 1.3 ulp of the exact value (tested over
   [-87, -17] for float, [-708, -37] for double); NaN stays NaN. x < -87 (float) or x < -708 (double) gives 0: 2^k
   built in the exponent bits must stay a normal number, so the cut sits a little above where e^x leaves the normal
   range (FLT_MIN = e^-87.34, DBL_MIN = e^-708.40), and the few normal results in between are flushed to 0 along with
   every subnormal one. */
static NV_INLINE float nv_exp_f32(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23, whose bits are 0x4B400000 */
    const float c = x > 88.0f ? 88.0f : x < -87.0f ? -87.0f : x;
    const float v = c * 1.44269504088896341f + shifter;
    const float k = v - shifter;
    const float r = (c - k * 0.693359375f) - k * -2.12194440054690583e-4f;
    float p = 1.98412698412698413e-4f;
    p = p * r + 1.38888888888888889e-3f;
    p = p * r + 8.33333333333333333e-3f;
    p = p * r + 4.16666666666666667e-2f;
    p = p * r + 1.66666666666666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits - 0x4B400000u + 127u) << 23; /* k + 127 in the exponent field */
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return x < -87.0f ? 0.0f : p * two_k;
}

static NV_INLINE double nv_exp_f64(double x) {
    const double shifter = 6755399441055744.0; /* 1.5 * 2^52, whose bits are 0x4338000000000000 */
    const double c = x > 709.0 ? 709.0 : x < -708.0 ? -708.0 : x;
    const double v = c * 1.44269504088896340736 + shifter;
    const double k = v - shifter;
    const double r = (c - k * 0.6931471806019544601440) - k * -4.2009150726810846e-11;
    static const double taylor[] = {1.6059043836821613e-10, 2.08767569878681e-09, 2.505210838544172e-08,
                                    2.755731922398589e-07,  2.7557319223985893e-06, 2.48015873015873e-05,
                                    1.984126984126984e-04,  1.388888888888889e-03, 8.333333333333333e-03,
                                    4.1666666666666664e-02, 0.16666666666666666,   0.5,
                                    1.0,                    1.0};
    double p = taylor[0];
    for (int i = 1; i < 14; i++) p = p * r + taylor[i];
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits = (bits - 0x4338000000000000u + 1023u) << 52; /* k + 1023 in the exponent field */
    double two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return x < -708.0 ? 0.0 : p * two_k;
}

/* The prefill's vector width in bytes, which names the instruction-set path this build took (64: AVX-512, 32: AVX,
   16: SSE or none); its bits are the same on each. */
int64_t nv_attention_vector_bytes(void) { return NV_VBYTES; }

#define NV_T float
#define NV_NAME(x) x##_f32
#define NV_EXP nv_exp_f32
#include "cpu_attention.c" /* this file, once per type */
#undef NV_T
#undef NV_NAME
#undef NV_EXP

#define NV_T double
#define NV_NAME(x) x##_f64
#define NV_EXP nv_exp_f64
#include "cpu_attention.c" /* this file, once per type */
#undef NV_T
#undef NV_NAME
#undef NV_EXP

#else /* the body, for one element type NV_T */

static NV_INLINE NV_T NV_NAME(dot)(const NV_T *restrict a, const NV_T *restrict b, int64_t d) {
    NV_T lane[NV_LANES] = {0};
    int64_t i = 0;
    for (; i + NV_LANES <= d; i += NV_LANES)
        for (int l = 0; l < NV_LANES; l++) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; i < d; i++, l++) lane[l] += a[i] * b[i];
    /* A fixed halving tree, written out so that it stays in registers. */
    for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];
    for (int l = 0; l < 4; l++) lane[l] += lane[l + 4];
    for (int l = 0; l < 2; l++) lane[l] += lane[l + 2];
    return lane[0] + lane[1];
}

/* Softmax of s[0..n) in place (n >= 1): exp(s - max) / sum. The maximum (exact in any order) and the sum are taken
   in NV_LANES lanes, then a fixed halving tree, so every loop vectorises. */
static NV_INLINE void NV_NAME(softmax)(NV_T *restrict s, int64_t n) {
    NV_T lane[NV_LANES];
    for (int l = 0; l < NV_LANES; l++) lane[l] = s[0];
    int64_t t = 0;
    for (; t + NV_LANES <= n; t += NV_LANES)
        for (int l = 0; l < NV_LANES; l++) lane[l] = s[t + l] > lane[l] ? s[t + l] : lane[l];
    for (int l = 0; t < n; t++, l++) lane[l] = s[t] > lane[l] ? s[t] : lane[l];
    for (int w = NV_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = lane[l + w] > lane[l] ? lane[l + w] : lane[l];
    const NV_T top = lane[0];
    for (t = 0; t < n; t++) s[t] = NV_EXP(s[t] - top);
    for (int l = 0; l < NV_LANES; l++) lane[l] = 0;
    for (t = 0; t + NV_LANES <= n; t += NV_LANES)
        for (int l = 0; l < NV_LANES; l++) lane[l] += s[t + l];
    for (int l = 0; t < n; t++, l++) lane[l] += s[t];
    for (int l = 0; l < 8; l++) lane[l] += lane[l + 8];
    for (int l = 0; l < 4; l++) lane[l] += lane[l + 4];
    for (int l = 0; l < 2; l++) lane[l] += lane[l + 2];
    const NV_T sum = lane[0] + lane[1];
    for (t = 0; t < n; t++) s[t] /= sum;
}

typedef struct {
    int64_t heads, kv_heads, head_dim, block_size, q_head_stride;
} NV_NAME(dims);

/* Query heads of KV heads [j0, j1) of one row, context n >= 1, head dim d: q and out point at the row's head 0;
   scores holds (j1 - j0) * rep * n values. Each cached token's row is read once per pass, all heads of the chunk
   together; while block c is read, block c + 1 of the same pass is prefetched (and, in the K pass, block c of V),
   so the scattered blocks arrive from memory while the previous one is being computed. Inlined into a copy per
   common head dim, which the compiler specialises (loops unrolled, partial sums kept in registers). */
static NV_INLINE void NV_NAME(attend_row_d)(const NV_T *restrict q, const NV_T *restrict k_cache,
                                           const NV_T *restrict v_cache, const int32_t *table, int64_t n, int64_t j0,
                                           int64_t j1, const NV_NAME(dims) *s, NV_T scale, NV_T *restrict scores,
                                           NV_T *restrict out, const int64_t d) {
    const int64_t bs = s->block_size, rep = s->heads / s->kv_heads;
    const int64_t token = s->kv_heads * d; /* elements per cached token */
    const int64_t first = j0 * rep, count = (j1 - j0) * rep, blocks = (n + bs - 1) / bs;
    for (int64_t c = 0; c < blocks; c++) {
        const int64_t t0 = c * bs, m = n - t0 < bs ? n - t0 : bs;
        const NV_T *block = k_cache + (int64_t)table[c] * bs * token;
        const NV_T *next = c + 1 < blocks ? k_cache + (int64_t)table[c + 1] * bs * token : block;
        const NV_T *values = v_cache + (int64_t)table[c] * bs * token;
        for (int64_t o = 0; o < m; o++) {
            for (int64_t e = j0 * d; e < j1 * d; e += NV_LINE) {
                nv_prefetch(next + o * token + e);
                nv_prefetch(values + o * token + e);
            }
            for (int64_t j = j0, g = 0; j < j1; j++)
                for (int64_t r = 0; r < rep; r++, g++) {
                    const NV_T *key = block + o * token + j * d;
                    scores[g * n + t0 + o] = NV_NAME(dot)(q + (first + g) * s->q_head_stride, key, d) * scale;
                }
        }
    }
    for (int64_t g = 0; g < count; g++) NV_NAME(softmax)(scores + g * n, n);
    NV_T *acc = out + first * d;
    for (int64_t i = 0; i < count * d; i++) acc[i] = 0;
    for (int64_t c = 0; c < blocks; c++) {
        const int64_t t0 = c * bs, m = n - t0 < bs ? n - t0 : bs;
        const NV_T *block = v_cache + (int64_t)table[c] * bs * token;
        const NV_T *next = c + 1 < blocks ? v_cache + (int64_t)table[c + 1] * bs * token : block;
        for (int64_t o = 0; o < m; o++) {
            for (int64_t e = j0 * d; e < j1 * d; e += NV_LINE) nv_prefetch(next + o * token + e);
            for (int64_t j = j0, g = 0; j < j1; j++)
                for (int64_t r = 0; r < rep; r++, g++) {
                    const NV_T *value = block + o * token + j * d;
                    const NV_T w = scores[g * n + t0 + o];
                    NV_T *a = acc + g * d;
                    for (int64_t i = 0; i < d; i++) a[i] += w * value[i];
                }
        }
    }
}

static void NV_NAME(attend_row)(const NV_T *q, const NV_T *k_cache, const NV_T *v_cache, const int32_t *table,
                                int64_t n, int64_t j0, int64_t j1, const NV_NAME(dims) *s, NV_T scale, NV_T *scores,
                                NV_T *out) {
    switch (s->head_dim) {
    case 64:
        NV_NAME(attend_row_d)(q, k_cache, v_cache, table, n, j0, j1, s, scale, scores, out, 64);
        break;
    case 128:
        NV_NAME(attend_row_d)(q, k_cache, v_cache, table, n, j0, j1, s, scale, scores, out, 128);
        break;
    default:
        NV_NAME(attend_row_d)(q, k_cache, v_cache, table, n, j0, j1, s, scale, scores, out, s->head_dim);
    }
}

/* out[B, h, d] = decode attention of q over each row's paged context. Returns 0, 1 + the first row whose table
   does not hold its context (nothing written), or -1 when a score buffer could not be allocated. */
int64_t NV_NAME(nv_paged_decode)(const NV_T *q, int64_t q_row_stride, int64_t q_head_stride, const NV_T *k_cache,
                                 const NV_T *v_cache, int64_t num_blocks, int64_t block_size,
                                 const int32_t *context_lens, const int32_t *block_tables, int64_t width, NV_T *out,
                                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                                 int64_t threads) {
    int64_t max_len = 0;
    int64_t bad = nv_check_tables(context_lens, block_tables, batch, width, block_size, num_blocks, &max_len);
    if (bad != 0 || batch == 0) return bad;
    const NV_NAME(dims) dims = {heads, kv_heads, head_dim, block_size, q_head_stride};
    const int64_t rep = heads / kv_heads;
    const int64_t chunks = nv_head_chunks(batch, kv_heads, threads < 1 ? 1 : threads);
    const int64_t units = batch * chunks;
    const int64_t chunk_heads = (kv_heads + chunks - 1) / chunks * rep;
    const int team = (int)(threads < 1 ? 1 : threads < units ? threads : units);
    int failed = 0;
    const nv_fpenv env = nv_fpenv_get();
#pragma omp parallel num_threads(team)
    {
        const nv_fpenv own = nv_fpenv_get();
        nv_fpenv_set(env);
        NV_T *scores = malloc(sizeof(NV_T) * (size_t)(chunk_heads * max_len + 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            const int64_t b = u / chunks, c = u % chunks;
            const int64_t j0 = kv_heads * c / chunks, j1 = kv_heads * (c + 1) / chunks;
            NV_T *row_out = out + b * heads * head_dim;
            const int64_t n = context_lens[b];
            if (scores == NULL) {
#pragma omp atomic write
                failed = 1;
            } else if (n == 0) {
                for (int64_t i = j0 * rep * head_dim; i < j1 * rep * head_dim; i++) row_out[i] = 0;
            } else {
                NV_NAME(attend_row)(q + b * q_row_stride, k_cache, v_cache, block_tables + b * width, n, j0, j1,
                                    &dims, (NV_T)scale, scores, row_out);
            }
        }
        free(scores);
        nv_fpenv_set(own);
    }
    return failed ? -1 : 0;
}

/* NV_KEYS keys (or output elements) as one vector of the target's widest type (GNU C vector extension): each lane
   rounds as its scalar would, and every lane is a different key or output element summed in its own fixed order,
   so the width changes no bit. */
typedef NV_T NV_NAME(vec) __attribute__((vector_size(NV_VBYTES)));
enum { NV_NAME(keys) = NV_VBYTES / sizeof(NV_T) };
#define NV_KEYS ((int64_t)NV_NAME(keys))

static NV_INLINE NV_NAME(vec) NV_NAME(load)(const NV_T *p) {
    NV_NAME(vec) x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* The keys of KV head j of a context of n tokens, transposed in blocks of NV_KEYS keys: element e of key t is
   kt[(t / NV_KEYS) * d * NV_KEYS + e * NV_KEYS + t % NV_KEYS], zeros past n up to the next whole block. */
static NV_INLINE void NV_NAME(transpose_keys)(const NV_T *restrict k_cache, const int32_t *table, int64_t n,
                                             int64_t j, const NV_NAME(dims) *s, NV_T *restrict kt, const int64_t d) {
    const int64_t bs = s->block_size, token = s->kv_heads * d, padded = (n + NV_KEYS - 1) / NV_KEYS * NV_KEYS;
    for (int64_t t0 = 0, c = 0; t0 < n; t0 += bs, c++) {
        const NV_T *block = k_cache + (int64_t)table[c] * bs * token + j * d;
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        for (int64_t o = 0; o < m; o++) {
            const int64_t t = t0 + o;
            NV_T *to = kt + t / NV_KEYS * d * NV_KEYS + t % NV_KEYS;
            for (int64_t e = 0; e < d; e++) to[e * NV_KEYS] = block[o * token + e];
        }
    }
    for (int64_t t = n; t < padded; t++)
        for (int64_t e = 0; e < d; e++) kt[t / NV_KEYS * d * NV_KEYS + e * NV_KEYS + t % NV_KEYS] = 0;
}

/* scores[v][k] = dot(q[v], key k) * scale, the decode's dot product, for NV_SQ query vectors and the NV_KEYS keys
   of one transposed block: lane l of key k sums q[i] * key[i] over i = l, l + NV_LANES, ... in that order, held as
   one vector across the keys (lanes l and l + 8 together, each key block row loaded once for all NV_SQ vectors),
   then the same halving tree, one vector add per step, so every key gets exactly dot()'s additions. */
static NV_INLINE void NV_NAME(dot_keys)(const NV_T *const *q, const NV_T *restrict kt, NV_T scale,
                                       NV_T *const *scores, const int64_t d) {
    const int64_t whole = d / NV_LANES * NV_LANES;
    NV_NAME(vec) half[NV_SQ][8];
    for (int l = 0; l < 8; l++) {
        NV_NAME(vec) lo[NV_SQ], hi[NV_SQ];
        for (int v = 0; v < NV_SQ; v++) lo[v] = hi[v] = (NV_NAME(vec)){0};
        for (int64_t i = 0; i < whole; i += NV_LANES) {
            const NV_NAME(vec) klo = NV_NAME(load)(kt + (i + l) * NV_KEYS);
            const NV_NAME(vec) khi = NV_NAME(load)(kt + (i + l + 8) * NV_KEYS);
            for (int v = 0; v < NV_SQ; v++) {
                lo[v] += q[v][i + l] * klo;
                hi[v] += q[v][i + l + 8] * khi;
            }
        }
        if (whole + l < d) {
            const NV_NAME(vec) klo = NV_NAME(load)(kt + (whole + l) * NV_KEYS);
            for (int v = 0; v < NV_SQ; v++) lo[v] += q[v][whole + l] * klo;
        }
        if (whole + l + 8 < d) {
            const NV_NAME(vec) khi = NV_NAME(load)(kt + (whole + l + 8) * NV_KEYS);
            for (int v = 0; v < NV_SQ; v++) hi[v] += q[v][whole + l + 8] * khi;
        }
        for (int v = 0; v < NV_SQ; v++) half[v][l] = lo[v] + hi[v];
    }
    for (int v = 0; v < NV_SQ; v++) {
        NV_NAME(vec) *lane = half[v];
        for (int l = 0; l < 4; l++) lane[l] += lane[l + 4];
        for (int l = 0; l < 2; l++) lane[l] += lane[l + 2];
        const NV_NAME(vec) scaled = (lane[0] + lane[1]) * scale;
        memcpy(scores[v], &scaled, sizeof scaled);
    }
}

/* os[q][e] = sum over keys t < seen[q], in token order, of w[q][t] * V[t][e] (the decode's order: a sum from +0,
   one key after another) for the elements e0 .. e0 + chunks * NV_KEYS - 1 of NV_VQ query vectors together, held in
   registers while V is read in place once for all of them; only the first `vecs` are written. seen[] is
   nondecreasing: the keys all of them see are taken together, then each one's own last few. */
static NV_INLINE void NV_NAME(weigh_span)(const NV_T *restrict v_cache, const int32_t *table, int64_t j,
                                         const NV_NAME(dims) *s, NV_T *const *w, NV_T *const *os,
                                         const int64_t *seen, int64_t vecs, int64_t e0, const int chunks,
                                         const int64_t d) {
    const int64_t bs = s->block_size, token = s->kv_heads * d, common = seen[0];
    NV_NAME(vec) acc[NV_VQ][NV_VCH];
    for (int q = 0; q < NV_VQ; q++)
        for (int c = 0; c < chunks; c++) acc[q][c] = (NV_NAME(vec)){0};
    for (int64_t t0 = 0, b = 0; t0 < common; t0 += bs, b++) {
        const NV_T *block = v_cache + (int64_t)table[b] * bs * token + j * d + e0;
        const int64_t m = common - t0 < bs ? common - t0 : bs;
        for (int64_t o = 0; o < m; o++) {
            NV_NAME(vec) x[NV_VCH];
            for (int c = 0; c < chunks; c++) x[c] = NV_NAME(load)(block + o * token + c * NV_KEYS);
            for (int q = 0; q < NV_VQ; q++) {
                const NV_T weight = w[q][t0 + o];
                for (int c = 0; c < chunks; c++) acc[q][c] += weight * x[c];
            }
        }
    }
    for (int q = 0; q < NV_VQ; q++) {
        for (int64_t t = common; t < seen[q]; t++) {
            const NV_T *row = v_cache + ((int64_t)table[t / bs] * bs + t % bs) * token + j * d + e0;
            for (int c = 0; c < chunks; c++) acc[q][c] += w[q][t] * NV_NAME(load)(row + c * NV_KEYS);
        }
        if (q < vecs)
            for (int c = 0; c < chunks; c++) memcpy(os[q] + e0 + c * NV_KEYS, &acc[q][c], sizeof acc[q][c]);
    }
}

/* weigh_span over all d elements: NV_VCH vectors at a time, then one, then the last few elements one by one (the
   same sum, per element). */
static NV_INLINE void NV_NAME(weigh_values)(const NV_T *restrict v_cache, const int32_t *table, int64_t j,
                                           const NV_NAME(dims) *s, NV_T *const *w, NV_T *const *os,
                                           const int64_t *seen, int64_t vecs, const int64_t d) {
    const int64_t bs = s->block_size, token = s->kv_heads * d;
    int64_t e0 = 0;
    for (; e0 + NV_VCH * NV_KEYS <= d; e0 += NV_VCH * NV_KEYS)
        NV_NAME(weigh_span)(v_cache, table, j, s, w, os, seen, vecs, e0, NV_VCH, d);
    for (; e0 + NV_KEYS <= d; e0 += NV_KEYS) NV_NAME(weigh_span)(v_cache, table, j, s, w, os, seen, vecs, e0, 1, d);
    for (int q = 0; q < vecs; q++)
        for (int64_t e = e0; e < d; e++) {
            NV_T sum = 0;
            for (int64_t t = 0; t < seen[q]; t++)
                sum += w[q][t] * v_cache[((int64_t)table[t / bs] * bs + t % bs) * token + j * d + e];
            os[q][e] = sum;
        }
}

/* Causal attention of the queries of KV head j of one sequence (context n, the last qlen positions; vector
   v = i * rep + r is query i's head j * rep + r and sees keys 0 .. n - qlen + i), NV_TILE vectors at a time: their
   scores against each block of NV_KEYS transposed keys (the block stays in cache while the tile reads it), each
   the decode's dot product (dot_keys), a softmax over exactly the vector's visible keys, then the weighted sum of V
   read in place, in the decode's order. So a query's output is the decode's for the same query and keys, bit for
   bit (spec/batch-invariance.md BI-4). q points at the sequence's first query row, out at its first output row
   ([qlen, h, d] contiguous); kt holds d * stride values and scores NV_TILE * stride, stride being n rounded up to
   whole blocks of NV_KEYS. */
static NV_INLINE void NV_NAME(prefill_head_d)(const NV_T *restrict q, const NV_T *restrict k_cache,
                                             const NV_T *restrict v_cache, const int32_t *table, int64_t n,
                                             int64_t qlen, int64_t j, const NV_NAME(dims) *s, int64_t q_row_stride,
                                             NV_T scale, NV_T *restrict kt, NV_T *restrict scores,
                                             NV_T *restrict out, const int64_t d) {
    const int64_t rep = s->heads / s->kv_heads, count = qlen * rep;
    const int64_t stride = (n + NV_KEYS - 1) / NV_KEYS * NV_KEYS;
    NV_NAME(transpose_keys)(k_cache, table, n, j, s, kt, d);
    for (int64_t v0 = 0; v0 < count; v0 += NV_TILE) {
        const int64_t tile = count - v0 < NV_TILE ? count - v0 : NV_TILE;
        const NV_T *qs[NV_TILE];
        NV_T *os[NV_TILE + NV_VQ], *ws[NV_TILE + NV_VQ];
        int64_t seen[NV_TILE + NV_VQ];
        for (int64_t v = 0; v < NV_TILE + NV_VQ; v++) {
            /* Past the tile's end the last vector stands in, so that weigh_values always takes NV_VQ vectors
               (it writes only the real ones). */
            const int64_t vec = v0 + (v < tile ? v : tile - 1), i = vec / rep, r = vec % rep;
            if (v < NV_TILE) qs[v] = q + i * q_row_stride + (j * rep + r) * s->q_head_stride;
            os[v] = out + (i * s->heads + j * rep + r) * d;
            ws[v] = scores + (v < tile ? v : tile - 1) * stride;
            seen[v] = n - qlen + i + 1;
        }
        const int64_t reach = seen[tile - 1];
        for (int64_t t0 = 0, first = 0; t0 < reach; t0 += NV_KEYS) {
            while (seen[first] <= t0) first++; /* the vectors from first on see this block */
            for (int64_t v = first; v < tile; v += NV_SQ) {
                /* Past the tile's end the last vector stands in (its scores written twice, the same bits). */
                const NV_T *group[NV_SQ];
                NV_T *into[NV_SQ];
                for (int g = 0; g < NV_SQ; g++) {
                    const int64_t u = v + g < tile ? v + g : tile - 1;
                    group[g] = qs[u];
                    into[g] = ws[u] + t0;
                }
                NV_NAME(dot_keys)(group, kt + t0 * d, scale, into, d);
            }
        }
        for (int64_t v = 0; v < tile; v++) NV_NAME(softmax)(ws[v], seen[v]);
        for (int64_t v = 0; v < tile; v += NV_VQ)
            NV_NAME(weigh_values)(v_cache, table, j, s, ws + v, os + v, seen + v,
                                  tile - v < NV_VQ ? tile - v : NV_VQ, d);
    }
}

static void NV_NAME(prefill_head)(const NV_T *q, const NV_T *k_cache, const NV_T *v_cache, const int32_t *table,
                                  int64_t n, int64_t qlen, int64_t j, const NV_NAME(dims) *s, int64_t q_row_stride,
                                  NV_T scale, NV_T *kt, NV_T *scores, NV_T *out) {
    switch (s->head_dim) {
    case 64:
        NV_NAME(prefill_head_d)(q, k_cache, v_cache, table, n, qlen, j, s, q_row_stride, scale, kt, scores, out, 64);
        break;
    case 128:
        NV_NAME(prefill_head_d)(q, k_cache, v_cache, table, n, qlen, j, s, q_row_stride, scale, kt, scores, out, 128);
        break;
    default:
        NV_NAME(prefill_head_d)(q, k_cache, v_cache, table, n, qlen, j, s, q_row_stride, scale, kt, scores, out,
                                s->head_dim);
    }
}

/* out[N, h, d] = causal prefill attention of the packed queries q[N, h, d] (sequence b owns rows cu_seqlens[b] ..
   cu_seqlens[b + 1] - 1, the last positions of its context). Returns 0, 1 + the first sequence whose queries or
   table do not fit its context (nothing written), or -1 when a buffer could not be allocated. */
int64_t NV_NAME(nv_paged_prefill)(const NV_T *q, int64_t q_row_stride, int64_t q_head_stride, const NV_T *k_cache,
                                  const NV_T *v_cache, int64_t num_blocks, int64_t block_size,
                                  const int32_t *cu_seqlens, const int32_t *context_lens,
                                  const int32_t *block_tables, int64_t width, NV_T *out, int64_t batch,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, int64_t threads) {
    int64_t max_len = 0;
    int64_t bad = nv_check_tables(context_lens, block_tables, batch, width, block_size, num_blocks, &max_len);
    if (bad == 0) bad = nv_check_queries(cu_seqlens, context_lens, batch);
    if (bad != 0 || batch == 0) return bad;
    const NV_NAME(dims) dims = {heads, kv_heads, head_dim, block_size, q_head_stride};
    const int64_t units = batch * kv_heads;
    const int64_t stride = (max_len + NV_KEYS - 1) / NV_KEYS * NV_KEYS;
    const int team = (int)(threads < 1 ? 1 : threads < units ? threads : units);
    int failed = 0;
    const nv_fpenv env = nv_fpenv_get();
#pragma omp parallel num_threads(team)
    {
        const nv_fpenv own = nv_fpenv_get();
        nv_fpenv_set(env);
        /* Whole vectors, so that the transposed keys' blocks are aligned to their size. */
        NV_T *kt = aligned_alloc(NV_VBYTES, sizeof(NV_T) * (size_t)(head_dim * stride + NV_KEYS));
        NV_T *scores = malloc(sizeof(NV_T) * (size_t)(NV_TILE * stride + 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            const int64_t b = u / kv_heads, j = u % kv_heads;
            const int64_t first = cu_seqlens[b], qlen = (int64_t)cu_seqlens[b + 1] - first;
            if (kt == NULL || scores == NULL) {
#pragma omp atomic write
                failed = 1;
            } else if (qlen > 0) {
                NV_NAME(prefill_head)(q + first * q_row_stride, k_cache, v_cache, block_tables + b * width,
                                      context_lens[b], qlen, j, &dims, q_row_stride, (NV_T)scale, kt, scores,
                                      out + first * heads * head_dim);
            }
        }
        free(scores);
        free(kt);
        nv_fpenv_set(own);
    }
    return failed ? -1 : 0;
}

#undef NV_KEYS

#endif
