/* Paged decode attention on the CPU, reading K and V in place from the paged cache (spec/kernels.md KERN-22).

Invariants: the caches are [num_blocks, block_size, kvh, d] and contiguous; q is [B, h, d] with any row and head
strides but unit stride inside a head; out is [B, h, d] and contiguous. Row b attends over the first
context_lens[b] slots named by its block-table row (stride `width`), every one of which must name a block in
[0, num_blocks): the tables are checked before anything is written, and a bad row is reported, never read. Query
head g uses KV head g / (h / kvh). All arithmetic is in the element type T (float or double) with IEEE semantics
(no -ffast-math): dot products with NV_LANES partial sums in a fixed order, scaled, a softmax with the maximum
subtracted and normalised weights, then the weighted sum of V. A row with context 0 outputs zeros. Rows are
independent, so they run in parallel over an explicit thread count; each thread keeps its own score buffer.

The body below is written once for a type T and instantiated for float and double by including this file into
itself (the C way to write a function template).
*/

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#ifndef NV_T

/* A fixed count of partial sums per dot product: the compiler maps them onto vector lanes without reordering any
   sum (which IEEE semantics forbid it to do itself), and the result does not depend on the machine's vector width. */
#define NV_LANES 16 /* the halving tree in dot() is written for 16 */
/* Elements of type float per 64-byte cache line; prefetching every this many elements of a double row touches
   each line at least once too (twice, harmlessly). */
#define NV_LINE 16

#if defined(__GNUC__)
#define NV_INLINE inline __attribute__((always_inline))
#define nv_prefetch(p) __builtin_prefetch((p), 0, 3)
#else
#define NV_INLINE inline
#define nv_prefetch(p) ((void)(p))
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

/* How many chunks of KV heads each row is cut into, so that a batch of fewer rows than threads still has work
   for every thread. */
static int64_t nv_head_chunks(int64_t batch, int64_t kv_heads, int64_t threads) {
    if (batch >= threads) return 1;
    int64_t chunks = (threads + batch - 1) / batch;
    return chunks < kv_heads ? chunks : kv_heads;
}

#define NV_T float
#define NV_NAME(x) x##_f32
#define NV_EXP expf
#include "cpu_attention.c" /* this file, once per type */
#undef NV_T
#undef NV_NAME
#undef NV_EXP

#define NV_T double
#define NV_NAME(x) x##_f64
#define NV_EXP exp
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

/* Softmax of s[0..n) in place (n >= 1): exp(s - max) / sum. */
static void NV_NAME(softmax)(NV_T *s, int64_t n) {
    NV_T top = s[0];
    for (int64_t t = 1; t < n; t++)
        if (s[t] > top) top = s[t];
    NV_T sum = 0;
    for (int64_t t = 0; t < n; t++) {
        s[t] = NV_EXP(s[t] - top);
        sum += s[t];
    }
    for (int64_t t = 0; t < n; t++) s[t] /= sum;
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
#pragma omp parallel num_threads(team)
    {
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
    }
    return failed ? -1 : 0;
}

#endif
