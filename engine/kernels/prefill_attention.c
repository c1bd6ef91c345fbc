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
 * per-token kernel, so any token range is valid input.
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

/* Attention for prefill tokens [first, first + count) (same addressing as paged_attention). */
void prefill_attention(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q, int64_t q_stride,
                       void *out, int64_t out_stride) {
    if (prefill_attention_amx(s, layer, first, count, q, q_stride, out, out_stride) == 0) return;
    const int G = s->num_heads / s->num_kv_heads;
#if defined(__AVX512BF16__)
    if (s->bf16 && s->head_dim % 32 == 0 && s->head_dim <= 256 && s->window == 0 && G <= MAXR) {
        const int qb = MAXR / G;
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
#endif
    (void)G;
    paged_attention(s, layer, first, count, q, q_stride, (char *)out, out_stride);
}
