/*
 * Attention of prefill tokens in query blocks (bf16 with AVX512-BF16).
 *
 * On CPUs with AMX bf16 the tile path (prefill_attention_amx.c) runs first and this one only
 * where it declines (measured on a Sapphire-Rapids-class Xeon, SmolLM2 512-token prefill, 2
 * threads: 30 layers' attention ~140 -> ~25-35 ms).
 *
 * Up to 12 rows, QB consecutive tokens of one sequence x the G query heads of one kv head,
 * score each 16-key tile together: the tile is transposed once into bf16 pairs (kt[p] = pair p
 * of the 16 keys' head dims) and each row accumulates its 16 scores with one dpbf16 per pair
 * of q broadcast: no per-key reduction, and the transpose is shared by every row. The
 * softmax and the V sum (two keys per dpbf16) are the per-token path's (attention_parts.h).
 *
 * Invariants: row (token at position P) sees keys [0, P] (causal within the chunk, the whole
 * cached prefix before it); its weights past its own context are exactly zero. Steps this
 * path cannot take (a sliding window, fp32, head_dim % 32 != 0 or > 256, G > 12) go to the
 * per-token kernel, so any token range is valid input. An int8 pool: one sequence's chunk that a
 * float pool would take in query blocks has its context's rows of the layer widened once into a
 * dense copy of the activation dtype and runs these paths on it (prefill_i8_dense: bf16 rounds the
 * widened rows as engine/kv_quant.py's dequantize does); other steps go to the per-token int8 path.
 */
#include <stdlib.h>

#include "attention_parts.h"

#define MAXR 12

void paged_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                     void *out, int64_t out_stride);
int prefill_attention_amx(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q,
                          int64_t q_stride, void *out, int64_t out_stride);

#if defined(__AVX512BF16__)
/* dst[r][0..16) = scale * q_r . k for the tile's 16 keys, for R <= MAXR rows. */
INLINE void qk_rows(const __m512i *kt, const uint32_t *const *qr, int R, int D, float scale, float *const *dst, int j0) {
    __m512 acc[MAXR];
    for (int r = 0; r < MAXR; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        const __m512bh k = (__m512bh)kt[p];
        for (int r = 0; r < MAXR; r++)
            if (r < R) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qr[r][p]), k);
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(dst[r] + j0, _mm512_mul_ps(acc[r], vs));
}

typedef struct {
    float *sc;
    uint16_t *pb;
    const char **rp;
} Scratch;

/* Tokens [t0, t0 + nq) (consecutive positions of one sequence) x kv head kh. */
static void attend_block(const Step *s, int layer, int t0, int nq, int kh, const void *q, int64_t q_stride,
                         void *out, int64_t out_stride, int first, const Scratch *w) {
    const int D = s->head_dim, G = s->num_heads / s->num_kv_heads, R = nq * G;
    const int64_t pstride = (int64_t)s->max_ctx + TILE, esz = 2;
    const int n = s->ctx_lens[t0 + nq - 1]; /* the last token sees the most keys */
    const int64_t v_bytes = esz * s->block_size * s->num_kv_heads * D;
    RowIter it;
    rows_init(&it, s, layer, s->token_row[t0], 0, 0, 0);
    for (int j = 0; j < n; j++) w->rp[j] = (const char *)rows_next(&it);
    const uint32_t *qr[MAXR];
    float *dst[MAXR];
    for (int r = 0; r < R; r++) {
        const int qi = r / G, h = kh * G + r % G;
        qr[r] = (const uint32_t *)((const uint16_t *)q + (int64_t)(t0 + qi) * q_stride + (int64_t)h * D);
        dst[r] = w->sc + r * pstride;
    }
    __m512i kt[128] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += TILE) {
        const int cnt = n - j0 < TILE ? n - j0 : TILE;
        const char *kp[TILE];
        for (int i = 0; i < TILE; i++) kp[i] = w->rp[j0 + (i < cnt ? i : 0)] + esz * kh * D;
        transpose_tile(kp, D, kt);
        qk_rows(kt, qr, R, D, s->scale, dst, j0);
    }
    float inv[MAXR];
    const uint16_t *pr[MAXR];
    uint16_t *orow[MAXR];
    for (int r = 0; r < R; r++) {
        const int qi = r / G, h = kh * G + r % G, nr = s->ctx_lens[t0 + qi];
        uint16_t *pb = w->pb + r * pstride;
        softmax_unnormalized(dst[r], nr);
        inv[r] = probs_bf16(dst[r], nr, pb);
        for (int j = nr; j <= n; j++) pb[j] = 0;
        pr[r] = pb;
        orow[r] = (uint16_t *)out + (int64_t)(t0 + qi - first) * out_stride + (int64_t)h * D;
    }
    const int64_t voff = v_bytes + esz * kh * D;
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int ng = R - r0 < 4 ? R - r0 : 4;
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int nc = (D - d0) / 32 < 2 ? (D - d0) / 32 : 2;
            pv_pass_bf16(w->rp, voff, n, pr + r0, inv + r0, ng, d0, nc, orow + r0);
        }
    }
}
#endif

#if defined(DUET_AVX2)
/* The AVX2 path (fp32 or bf16, head_dim % 16 == 0 and <= 256, no sliding window, G <= 16): a
 * query block is up to PR rows (consecutive tokens of one sequence x the G heads of one kv head),
 * kept transposed (qt[d][PR], two vectors of rows per head dim), so each score tile is a key's
 * element broadcast times the rows: PK keys x 2 row vectors of accumulators, no per-key
 * reduction and no transpose of the keys (the AVX-512 path transposes K tiles instead; AVX2 has
 * half the registers). Scores are kept key-major (st[j][PR]): the softmax of every row runs down
 * the columns in vectors, masked at each row's own context; the V sum takes the same weights as
 * vectors of rows times each key's elements broadcast (pv_cols8), so no pass spills its
 * accumulators (the decode path's 3 rows x 32 dims did, here). */
#define PR 16
#define PK 4

/* st[i][0..PR) = scale * q_r . k_i for the PK keys kp[i]; RV (1 or 2, a constant) row vectors. */
INLINE void qk_rows8(const float *qt, const char *const *kp, int D, float scale, float *st, const int bf16,
                     const int RV) {
    __m256 acc[PK][2];
    for (int i = 0; i < PK; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    if (bf16) { /* one broadcast of a key's bf16 pair (d, d + 1) gives both as fp32 (shift, mask) */
        const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
        for (int d = 0; d < D; d += 2) {
            const __m256 a0 = _mm256_load_ps(qt + d * PR), b0 = _mm256_load_ps(qt + (d + 1) * PR);
            const __m256 a1 = RV > 1 ? _mm256_load_ps(qt + d * PR + 8) : a0;
            const __m256 b1 = RV > 1 ? _mm256_load_ps(qt + (d + 1) * PR + 8) : b0;
            for (int i = 0; i < PK; i++) {
                int32_t pair;
                __builtin_memcpy(&pair, (const uint16_t *)kp[i] + d, sizeof pair);
                const __m256i w = _mm256_set1_epi32(pair);
                const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
                acc[i][0] = _mm256_fmadd_ps(b0, ko, _mm256_fmadd_ps(a0, ke, acc[i][0]));
                if (RV > 1) acc[i][1] = _mm256_fmadd_ps(b1, ko, _mm256_fmadd_ps(a1, ke, acc[i][1]));
            }
        }
    } else { /* the PK keys' element d broadcast first, then each row vector loaded once */
        for (int d = 0; d < D; d++) {
            __m256 k[PK];
            for (int i = 0; i < PK; i++) k[i] = _mm256_broadcast_ss((const float *)kp[i] + d);
            for (int v = 0; v < RV; v++) {
                const __m256 a = _mm256_load_ps(qt + d * PR + 8 * v);
                for (int i = 0; i < PK; i++) acc[i][v] = _mm256_fmadd_ps(a, k[i], acc[i][v]);
            }
        }
    }
    const __m256 vs = _mm256_set1_ps(scale);
    for (int i = 0; i < PK; i++)
        for (int v = 0; v < RV; v++) _mm256_store_ps(st + i * PR + 8 * v, _mm256_mul_ps(acc[i][v], vs));
}

/* Column-wise softmax of st[0..n)[PR]: row r's keys past ctx[r] weigh exactly 0; inv[r] = 1 / its sum.
 * `round` (bf16): the weights rounded to bf16, the sum of the unrounded ones (softmax8's rounding). */
INLINE void softmax_cols8(float *st, int n, const int32_t *ctx, float *inv, int RV, const int round) {
    for (int v = 0; v < RV; v++) {
        const __m256i cv = _mm256_loadu_si256((const __m256i *)(ctx + 8 * v));
        __m256 m = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < n; j++) {
            const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(cv, _mm256_set1_epi32(j)));
            m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(st + j * PR + 8 * v), ok));
        }
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const __m256 ok = _mm256_castsi256_ps(_mm256_cmpgt_epi32(cv, _mm256_set1_epi32(j)));
            const __m256 e = _mm256_and_ps(vec8_exp(_mm256_sub_ps(_mm256_load_ps(st + j * PR + 8 * v), m)), ok);
            _mm256_store_ps(st + j * PR + 8 * v, round ? vec8_round_bf16_finite(e) : e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(inv + 8 * v, _mm256_div_ps(_mm256_set1_ps(1.0f), sum));
    }
}

/* ot[d][r] = inv[r] * sum_j st[j][r] V_j[d] for dims [d0, d0 + ND) and every row (RV vectors): the
 * key-major weights times a key's elements broadcast, ND dims x 2 row vectors of accumulators (a
 * bf16 pair broadcast gives two dims). ND, RV and bf16 constants. */
INLINE void pv_cols8_k(const char *const *rp, int64_t voff, int n, const float *st, const float *inv, int d0,
                       float *ot, const int ND, const int RV, const int bf16) {
    __m256 acc[6][2];
    for (int e = 0; e < 6; e++) acc[e][0] = acc[e][1] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int j = 0; j < n; j++) {
        __m256 p[2];
        for (int v = 0; v < RV; v++) p[v] = _mm256_load_ps(st + j * PR + 8 * v);
        const char *vr = rp[j] + voff;
        for (int e = 0; e < ND; e += 2) {
            __m256 b0, b1;
            if (bf16) {
                int32_t pair;
                __builtin_memcpy(&pair, (const uint16_t *)vr + d0 + e, sizeof pair);
                const __m256i w = _mm256_set1_epi32(pair);
                b0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                b1 = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
            } else {
                b0 = _mm256_broadcast_ss((const float *)vr + d0 + e);
                b1 = _mm256_broadcast_ss((const float *)vr + d0 + e + 1);
            }
            for (int v = 0; v < RV; v++) {
                acc[e][v] = _mm256_fmadd_ps(b0, p[v], acc[e][v]);
                acc[e + 1][v] = _mm256_fmadd_ps(b1, p[v], acc[e + 1][v]);
            }
        }
    }
    for (int v = 0; v < RV; v++) {
        const __m256 sc = _mm256_loadu_ps(inv + 8 * v);
        for (int e = 0; e < ND; e++) _mm256_store_ps(ot + (d0 + e) * PR + 8 * v, _mm256_mul_ps(acc[e][v], sc));
    }
}

static void pv_cols8(const char *const *rp, int64_t voff, int n, const float *st, const float *inv, int D, float *ot,
                     int RV, int bf16) {
#define PVC(ND, R, B) pv_cols8_k(rp, voff, n, st, inv, d0, ot, ND, R, B)
#define PVC_ND(R, B)                                                                                                \
    for (int d0 = 0; d0 < D; d0 += 6) {                                                                             \
        if (D - d0 >= 6) PVC(6, R, B);                                                                              \
        else if (D - d0 == 4) PVC(4, R, B);                                                                         \
        else PVC(2, R, B);                                                                                          \
    }
    if (bf16) {
        if (RV > 1) { PVC_ND(2, 1) } else { PVC_ND(1, 1) }
    } else {
        if (RV > 1) { PVC_ND(2, 0) } else { PVC_ND(1, 0) }
    }
#undef PVC_ND
#undef PVC
}

typedef struct {
    float *qt; /* [256][PR], 32-byte aligned */
    float *st; /* [max_ctx + PK][PR], 32-byte aligned */
    const char **rp;
} Scratch8;

/* Tokens [t0, t0 + nq) (consecutive positions of one sequence) x kv head kh; nq * G <= PR. */
static void attend_block8(const Step *s, int layer, int t0, int nq, int kh, const void *q, int64_t q_stride,
                          void *out, int64_t out_stride, int first, const Scratch8 *w) {
    const int D = s->head_dim, G = s->num_heads / s->num_kv_heads, R = nq * G, bf16 = s->bf16;
    const int64_t esz = bf16 ? 2 : 4, v_bytes = esz * s->block_size * s->num_kv_heads * D;
    const int n = s->ctx_lens[t0 + nq - 1]; /* the last token sees the most keys */
    RowIter it;
    rows_init(&it, s, layer, s->token_row[t0], 0, 0, 0);
    for (int j = 0; j < n; j++) w->rp[j] = (const char *)rows_next(&it);
    for (int j = n; j < n + PK; j++) w->rp[j] = w->rp[0]; /* padding keys, masked out */
    int32_t ctx[PR];
    void *orow[PR];
    for (int r = 0; r < PR; r++) {
        ctx[r] = r < R ? s->ctx_lens[t0 + r / G] : 0;
        for (int d = 0; d < D; d++) w->qt[d * PR + r] = 0.f;
    }
    for (int r = 0; r < R; r++) {
        const int t = t0 + r / G, h = kh * G + r % G;
        const int64_t qo = (int64_t)t * q_stride + (int64_t)h * D;
        for (int d = 0; d < D; d++) w->qt[d * PR + r] = load_elem(q, qo + d, bf16);
        orow[r] = (char *)out + esz * ((int64_t)(t - first) * out_stride + (int64_t)h * D);
    }
    const int RV = R > 8 ? 2 : 1;
    for (int j0 = 0; j0 < n; j0 += PK) {
        const char *kp[PK];
        for (int i = 0; i < PK; i++) kp[i] = w->rp[j0 + i] + esz * kh * D;
        float *st = w->st + (int64_t)j0 * PR;
        if (bf16) {
            if (RV > 1) qk_rows8(w->qt, kp, D, s->scale, st, 1, 2);
            else qk_rows8(w->qt, kp, D, s->scale, st, 1, 1);
        } else {
            if (RV > 1) qk_rows8(w->qt, kp, D, s->scale, st, 0, 2);
            else qk_rows8(w->qt, kp, D, s->scale, st, 0, 1);
        }
    }
    float inv[PR];
    softmax_cols8(w->st, n, ctx, inv, RV, bf16);
    const int64_t voff = v_bytes + esz * kh * D;
    pv_cols8(w->rp, voff, n, w->st, inv, D, w->qt, RV, bf16); /* out^T into qt, no longer needed */
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) store_elem(orow[r], d, w->qt[d * PR + r], bf16);
}

/* Query blocks of up to PR / G consecutive tokens of one sequence, x kv heads, over the threads. */
static void prefill8(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                     void *out, int64_t out_stride) {
    const int G = s->num_heads / s->num_kv_heads, qb = PR / G, KVH = s->num_kv_heads;
    int *starts = (int *)malloc(sizeof(int) * (size_t)(count + 1));
    int nb = 0;
    for (int t = first; t < first + count; t++) {
        const int b0 = nb ? starts[nb - 1] : -1;
        if (nb == 0 || t - b0 >= qb || s->token_row[t] != s->token_row[b0] || s->positions[t] != s->positions[t - 1] + 1)
            starts[nb++] = t;
    }
    starts[nb] = first + count;
    const int64_t items = (int64_t)nb * KVH;
#pragma omp parallel
    {
        Scratch8 w;
        w.qt = (float *)aligned_alloc(32, sizeof(float) * 256 * PR);
        w.st = (float *)aligned_alloc(32, sizeof(float) * PR * ((size_t)s->max_ctx + PK));
        w.rp = (const char **)malloc(sizeof(char *) * ((size_t)s->max_ctx + PK));
        /* Last blocks first: they see the most keys (better balance). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = items - 1; i >= 0; i--) {
            const int b = (int)(i / KVH), kh = (int)(i % KVH);
            attend_block8(s, layer, starts[b], starts[b + 1] - starts[b], kh, q, q_stride, out, out_stride, first, &w);
        }
        free(w.rp);
        free(w.st);
        free(w.qt);
    }
    free(starts);
}
#endif

/* Whether a float pool's prefill takes a query-block path (prefill_attention's dispatch and the
 * int8 pool's dense copy both ask; else the per-token kernel). */
static int blocked_path(const Step *s) {
    const int G = s->num_heads / s->num_kv_heads;
    if (s->window != 0 || s->head_dim > 256) return 0;
#if defined(__AVX512BF16__)
    return s->bf16 && s->head_dim % 32 == 0 && G <= MAXR;
#elif defined(DUET_AVX2)
    return s->head_dim % 16 == 0 && G <= PR;
#else
    (void)G;
    return 0;
#endif
}

/* One int8 row (D values, then the fp32 scale) as D elements of the activation dtype: value x scale
 * in fp32, rounded once to bf16 for bf16 steps (engine/kv_quant.py's dequantize, bitwise). */
INLINE void dequant_row(const int8_t *src, int D, void *dst, int bf16) {
    float sc;
    __builtin_memcpy(&sc, src + D, sizeof sc);
#if defined(__AVX512F__)
    if ((D & 15) == 0) {
        const __m512 vs = _mm512_set1_ps(sc);
        for (int d = 0; d < D; d += 16)
            store16(dst, d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d)))), vs),
                    bf16);
        return;
    }
#elif defined(DUET_AVX2)
    if ((D & 7) == 0) {
        const __m256 vs = _mm256_set1_ps(sc);
        for (int d = 0; d < D; d += 8)
            store8(dst, d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + d)))), vs),
                   bf16);
        return;
    }
#endif
    for (int d = 0; d < D; d++) store_elem(dst, d, sc * (float)src[d], bf16);
}

void prefill_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                       void *out, int64_t out_stride);

/* An int8 pool's prefill chunk (tokens [first, first + count) of one sequence) where a float pool
 * would take a query-block path: its context's K/V rows of this layer dequantized once into a dense
 * pool of the activation dtype (rows past the context zero), then prefill_attention on a step over
 * that copy, so every query block shares the widened keys instead of each token widening them
 * again. Returns 1 where it does not apply (the per-token int8 path runs). */
static int prefill_i8_dense(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q,
                            int64_t q_stride, void *out, int64_t out_stride) {
    /* fewer tokens than a query block would pay for the copy without sharing it (a fully cached
     * prompt computes its last token alone): per token is cheaper */
    if (count < 4 || !blocked_path(s)) return 1;
    const int row = s->token_row[first];
    int n = 0;
    for (int t = first; t < first + count; t++) {
        if (s->token_row[t] != row) return 1;
        if (s->ctx_lens[t] > n) n = s->ctx_lens[t];
    }
    const int bs = s->block_size, D = s->head_dim, RW = D + 4, KVH = s->num_kv_heads;
    const int64_t nb = (n + bs - 1) / bs, esz = s->bf16 ? 2 : 4, blk = 2 * (int64_t)bs * KVH * D;
    const int64_t rows = 2 * (int64_t)bs * KVH; /* a block's (kv, offset, kv head) rows */
    char *dense = (char *)aligned_alloc(64, (size_t)((nb * blk * esz + 63) / 64 * 64));
    int64_t *table = (int64_t *)calloc((size_t)(row + 1) * (size_t)nb, sizeof(int64_t));
    if (dense == NULL || table == NULL) {
        free(dense);
        free(table);
        return 1;
    }
    const int64_t *src = s->block_tables + (int64_t)row * s->table_width;
    for (int64_t b = 0; b < nb; b++) table[(int64_t)row * nb + b] = b;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nb * rows; i++) {
        const int64_t b = i / rows, r = i % rows, pos = b * bs + (r / KVH) % bs;
        char *dst = dense + esz * (b * blk + r * D);
        if (pos >= n) {
            __builtin_memset(dst, 0, (size_t)(esz * D));
            continue;
        }
        const int8_t *row8 =
            (const int8_t *)s->cache + src[b] * s->block_stride + (int64_t)layer * s->layer_stride + r * RW;
        dequant_row(row8, D, dst, s->bf16);
    }
    Step d = *s;
    d.cache = dense;
    d.layer_stride = blk;
    d.block_stride = blk;
    d.block_tables = table;
    d.table_width = nb;
    d.kv_int8 = 0;
    prefill_attention(&d, 0, first, count, q, q_stride, out, out_stride);
    free(table);
    free(dense);
    return 0;
}

/* Attention for prefill tokens [first, first + count) (same addressing as paged_attention). */
void prefill_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                       void *out, int64_t out_stride) {
    if (s->kv_int8) { /* an int8 pool: widened once for the query blocks, else per token */
        if (prefill_i8_dense(s, layer, first, count, q, q_stride, out, out_stride) != 0)
            paged_attention(s, layer, first, count, q, q_stride, out, out_stride);
        return;
    }
    if (prefill_attention_amx(s, layer, first, count, q, q_stride, out, out_stride) == 0) return;
#if defined(__AVX512BF16__)
    if (blocked_path(s)) {
        const int G = s->num_heads / s->num_kv_heads, qb = MAXR / G;
        int *starts = (int *)malloc(sizeof(int) * (size_t)(count + 1));
        int nb = 0;
        for (int t = first; t < first + count; t++) {
            const int b0 = nb ? starts[nb - 1] : -1;
            if (nb == 0 || t - b0 >= qb || s->token_row[t] != s->token_row[b0] ||
                s->positions[t] != s->positions[t - 1] + 1)
                starts[nb++] = t;
        }
        starts[nb] = first + count;
        const int KVH = s->num_kv_heads;
        const int64_t items = (int64_t)nb * KVH;
#pragma omp parallel
        {
            Scratch w;
            w.sc = (float *)malloc(sizeof(float) * MAXR * ((size_t)s->max_ctx + TILE));
            w.pb = (uint16_t *)malloc(sizeof(uint16_t) * MAXR * ((size_t)s->max_ctx + TILE));
            w.rp = (const char **)malloc(sizeof(char *) * ((size_t)s->max_ctx + TILE));
            /* Last blocks first: they see the most keys (better balance). */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = items - 1; i >= 0; i--) {
                const int b = (int)(i / KVH), kh = (int)(i % KVH);
                attend_block(s, layer, starts[b], starts[b + 1] - starts[b], kh, q, q_stride, out, out_stride,
                             first, &w);
            }
            free(w.rp);
            free(w.pb);
            free(w.sc);
        }
        free(starts);
        return;
    }
#elif defined(DUET_AVX2)
    if (blocked_path(s)) {
        prefill8(s, layer, first, count, q, q_stride, out, out_stride);
        return;
    }
#endif
    paged_attention(s, layer, first, count, q, q_stride, (char *)out, out_stride);
}
