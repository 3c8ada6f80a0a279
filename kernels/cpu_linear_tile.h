/* The invariant linear's tile and driver for one precision (included by cpu_linear.c once per precision, with
   NVT_T the scalar, NVT_V its vector of NVT_PW lanes and the nvt_* operations defined; spec/batch-invariance.md
   BI-2 states the rule, cpu_linear.c's header how it is computed). Every output is one scalar chain of roundings:
   which tile, lane, path or thread computes it moves no bit. */

/* The pairwise tree of fixed_order_sum kept as a binary counter: level l holds the sum of the 2^l consecutive parts
   that bit l of `count` (the parts pushed so far) stands for. Pushing a part adds it to each complete subtree it
   completes, the earlier sum on the left; folding adds what is left, latest first, each on the right of the one
   before it: the level-by-level pairing of fixed_order_sum, an odd last part carried up. Parts live in memory,
   n vectors of NVT_PW each, touched once a block, so that no register of the k loop holds them. */
typedef NVT_T NVT_NAME(levels)[NVL_LEVELS][NVL_MAX_ACC * NVT_PW];

NVL_INLINE void NVT_NAME(push)(NVT_NAME(levels) * tree, int64_t count, NVT_T *part, const int n) {
    int l = 0;
    for (; (count >> l) & 1; l++)
        for (int a = 0; a < n; a++)
            nvt_store(part + a * NVT_PW, nvt_add(nvt_load((*tree)[l] + a * NVT_PW), nvt_load(part + a * NVT_PW)));
    for (int a = 0; a < n; a++) nvt_store((*tree)[l] + a * NVT_PW, nvt_load(part + a * NVT_PW));
}

NVL_INLINE void NVT_NAME(fold)(NVT_NAME(levels) * tree, int64_t count, NVT_T *sum, const int n) {
    int have = 0;
    for (int l = 0; l < NVL_LEVELS; l++) {
        if (!((count >> l) & 1)) continue;
        for (int a = 0; a < n; a++) {
            const NVT_V s = nvt_load((*tree)[l] + a * NVT_PW);
            nvt_store(sum + a * NVT_PW, have ? nvt_add(s, nvt_load(sum + a * NVT_PW)) : s);
        }
        have = 1;
    }
}

/* A tile of R rows by V panels (V * NVT_PW columns) into out[R * V][NVT_PW], R and V known at compile time where it
   is inlined, so the accumulators stay in registers: acc[r * V + v]. Each block's sums join its chunk's tree, each
   chunk's sums the layer's. */
NVL_INLINE void NVT_NAME(tile)(const NVT_T *x, int64_t ldx, const NVT_T *wp, int64_t K, int64_t chunks, NVT_T *out,
                               const int R, const int V) {
    const int64_t step = K / chunks, panel = K * NVT_PW;
    NVT_NAME(levels) blocks, sums;
    int64_t count = 0;
    for (int64_t c0 = 0; c0 < K; c0 += step) {
        const int64_t c1 = c0 + step;
        int64_t block = 0;
        for (int64_t b0 = c0; b0 < c1; b0 += NVL_BLOCK, block++) {
            const int64_t b1 = b0 + NVL_BLOCK < c1 ? b0 + NVL_BLOCK : c1;
            NVT_V acc[NVL_MAX_ACC];
            NVL_UNROLL for (int a = 0; a < R * V; a++) acc[a] = nvt_zero();
            _Pragma("GCC unroll 4") for (int64_t k = b0; k < b1; k++) {
                NVT_V wv[NVL_MAX_ACC];
                NVL_UNROLL for (int v = 0; v < V; v++) wv[v] = nvt_load(wp + v * panel + k * NVT_PW);
                NVL_UNROLL for (int r = 0; r < R; r++) {
                    const NVT_V xb = nvt_broadcast(x + r * ldx + k);
                    NVL_UNROLL for (int v = 0; v < V; v++) acc[r * V + v] = nvt_fma(xb, wv[v], acc[r * V + v]);
                }
            }
            /* push, the block's sums still in registers */
            int l = 0;
            for (; (block >> l) & 1; l++)
                NVL_UNROLL for (int a = 0; a < R * V; a++) acc[a] = nvt_add(nvt_load(blocks[l] + a * NVT_PW), acc[a]);
            NVL_UNROLL for (int a = 0; a < R * V; a++) nvt_store(blocks[l] + a * NVT_PW, acc[a]);
        }
        NVT_NAME(fold)(&blocks, block, out, R * V);
        NVT_NAME(push)(&sums, count++, out, R * V);
    }
    NVT_NAME(fold)(&sums, count, out, R * V);
}

/* The tile at [m, m + r) x panels [p, p + v) of a call, written to y (+ bias) for the columns below N. */
NVL_INLINE void NVT_NAME(tile_out)(const NVT_T *x, int64_t ldx, const NVT_T *wp, const NVT_T *bias, NVT_T *y,
                                   int64_t ldy, int64_t N, int64_t K, int64_t chunks, int64_t m, int64_t p,
                                   const int R, const int V) {
    NVT_T out[NVL_MAX_ACC * NVT_PW];
    NVT_NAME(tile)(x + m * ldx, ldx, wp + p * K * NVT_PW, K, chunks, out, R, V);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) {
            const int64_t n = (p + v) * NVT_PW;
            const NVT_T *s = out + (r * V + v) * NVT_PW;
            NVT_T *row = y + (m + r) * ldy + n;
            if (n + NVT_PW <= N) { /* a whole panel: one vector add (the same rounding as each scalar one) */
                nvt_store(row, bias != NULL ? nvt_add(nvt_load(s), nvt_load(bias + n)) : nvt_load(s));
                continue;
            }
            for (int64_t j = 0; j < N - n; j++) row[j] = bias != NULL ? s[j] + bias[n + j] : s[j];
        }
}

/* Each tile shape its own function (NVL_TILES lists the shapes), so that each k loop is register-allocated alone. */
#define NVT_TILE_FN(R, V)                                                                                             \
    static __attribute__((noinline)) void NVT_NAME(tile_##R##_##V)(                                                   \
        const NVT_T *x, int64_t ldx, const NVT_T *wp, const NVT_T *bias, NVT_T *y, int64_t ldy, int64_t N, int64_t K, \
        int64_t chunks, int64_t m, int64_t p) {                                                                       \
        NVT_NAME(tile_out)(x, ldx, wp, bias, y, ldy, N, K, chunks, m, p, R, V);                                       \
    }
NVL_TILES(NVT_TILE_FN)
#undef NVT_TILE_FN

/* Rows [m, m + r) over panels [p0, p1): tiles of NVL_WIDE(r) panels; the last 1 to 2 * NVL_WIDE(r) - 1 in one or
   two tiles of about half that, never a single-panel tile after wide ones (its one vector a k would keep each
   broadcast of x for one multiply-add). */
static void NVT_NAME(rows)(const NVT_T *x, int64_t ldx, const NVT_T *wp, const NVT_T *bias, NVT_T *y, int64_t ldy,
                           int64_t N, int64_t K, int64_t chunks, int64_t m, int64_t p0, int64_t p1, int r) {
    const int64_t wide = NVL_WIDE(r);
    for (int64_t p = p0; p < p1;) {
        const int64_t left = p1 - p;
        const int v = (int)(left >= 2 * wide || left == wide ? wide : left > wide ? (left + 1) / 2 : left);
        switch (r * 16 + v) {
#define NVT_TILE_CASE(R, V)                                                                                           \
    case (R) * 16 + (V):                                                                                              \
        NVT_NAME(tile_##R##_##V)(x, ldx, wp, bias, y, ldy, N, K, chunks, m, p);                                       \
        break;
            NVL_TILES(NVT_TILE_CASE)
#undef NVT_TILE_CASE
        default:
            break;
        }
        p += v;
    }
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N] when bias is not NULL) on up to `threads` threads, with w packed in
   panels (wp[p][k][j] = w[p * NVT_PW + j][k], columns past N zero) and K cut into `chunks` equal chunks (1 to
   2^NVL_LEVELS - 1, dividing K >= 1). Units of up to NVL_ROW_BLOCK rows (fewer when that gives each thread of the
   team rows of its own) by NVL_UNIT_PANELS panels, row block after row block, one thread each, so a layer of few
   panels splits as evenly as a wide one; a unit's tiles of rows re-read its panels from L2. */
void NVT_NAME(linear)(const NVT_T *x, int64_t ldx, const NVT_T *wp, const NVT_T *bias, NVT_T *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int64_t chunks, int64_t threads) {
    if (M <= 0 || N <= 0 || K <= 0 || chunks < 1 || K % chunks || chunks >= (1 << NVL_LEVELS) ||
        K / chunks > (int64_t)NVL_BLOCK * ((1 << NVL_LEVELS) - 1))
        return; /* refused by the caller (kernels/linear.py) first */
    const int64_t panels = (N + NVT_PW - 1) / NVT_PW;
    const int64_t panel_blocks = (panels + NVL_UNIT_PANELS - 1) / NVL_UNIT_PANELS;
    const int64_t wanted = nvl_team(threads, threads, M, N, K);
    int64_t rows = ((M + wanted - 1) / wanted + NVL_MAX_ROWS - 1) / NVL_MAX_ROWS * NVL_MAX_ROWS;
    if (rows > NVL_ROW_BLOCK) rows = NVL_ROW_BLOCK;
    const int64_t units = (M + rows - 1) / rows * panel_blocks;
    const int64_t team = wanted < units ? wanted : units;
#define NVT_UNIT(u)                                                                                                   \
    do {                                                                                                              \
        const int64_t m0 = (u) / panel_blocks * rows, p0 = (u) % panel_blocks * NVL_UNIT_PANELS;                      \
        const int64_t p1 = p0 + NVL_UNIT_PANELS < panels ? p0 + NVL_UNIT_PANELS : panels;                             \
        const int64_t m1 = m0 + rows < M ? m0 + rows : M;                                                             \
        for (int64_t m = m0; m < m1; m += NVL_MAX_ROWS) {                                                             \
            const int r = m1 - m < NVL_MAX_ROWS ? (int)(m1 - m) : NVL_MAX_ROWS;                                       \
            NVT_NAME(rows)(x, ldx, wp, bias, y, ldy, N, K, chunks, m, p0, p1, r);                                     \
        }                                                                                                             \
    } while (0)
    if (team == 1) { /* the calling thread, in its own environment */
        for (int64_t u = 0; u < units; u++) NVT_UNIT(u);
        return;
    }
    const nvl_fpenv env = nvl_fpenv_get();
#pragma omp parallel num_threads((int)team)
    {
        const nvl_fpenv own = nvl_fpenv_get();
        nvl_fpenv_set(env);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) NVT_UNIT(u);
        nvl_fpenv_set(own);
    }
#undef NVT_UNIT
}
