/*
 * Attention of prefill tokens on AMX bf16 tiles (CPUs with amx_bf16, e.g. Sapphire Rapids and
 * later Xeons), flash-style: one work item is 16 consecutive tokens of one chunk x one query
 * head; it walks the chunk's keys 32 at a time with an online softmax, so no score row of the
 * whole context is ever stored.
 *
 * Per (chunk, kv head) the keys are first laid out once, in the tiles' B layout, in a buffer the
 * work items of that kv head share: K as pairs of head dims x 16 keys (the transpose the AVX-512
 * path makes per query block, made once here), V as pairs of keys x 16 head dims. Then, for each
 * 32-key step: S = Q K^T in two 16x16 fp32 tiles (tdpbf16ps over 32-dim slices of the head);
 * per row, in AVX-512, the running max, the rescale of the output accumulator and the sum, and
 * p = exp(s - max) rounded to bf16; O += P V on tiles. The next step's S is issued before this
 * step's softmax, so tiles and vector units work side by side; with head_dim 64 the fp32
 * accumulator stays in four tiles for the whole walk (other sizes pass it through L1), and a row
 * is rescaled only when its max grows by more than TAU (each rescale sends the tiles through
 * memory).
 *
 * Invariants: as prefill_attention.c. Row (token at position P) sees keys [0, P] (causal within
 * the chunk, the whole cached prefix before it); masked and padding keys get weight exactly 0
 * (padding keys are zero rows, so 0 * V stays 0). The output is normalized by the sum of the
 * bf16-rounded weights it used. Equal to softmax(q.K^T * scale).V within bf16 rounding, not
 * bitwise equal to the AVX-512 path (other summation order). Steps this path does not take
 * (fp32, a sliding window, head_dim % 32 != 0 or > 256, no tile permission from the OS) return
 * 1 and go to prefill_attention.c's path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_parts.h"

int prefill_attention_amx(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q,
                          int64_t q_stride, void *out, int64_t out_stride);

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define QR 16 /* query rows per work item (one tile's rows) */
#define KS 32 /* keys per softmax step (one P tile's columns) */
#define TILE_U16 512 /* uint16 in one 16 x 64-byte tile */

typedef struct {
    int t0, len; /* the chunk's first token (step index) and its token count */
    int n; /* keys its last token sees */
    int steps; /* ceil(n / KS) */
    int blocks; /* ceil(len / QR): its work items per query head */
    int64_t buf; /* offset of its kv head 0 buffer, in uint16 */
} Chunk;

/* One (chunk, kv head) buffer: `steps` K parts (D/32 slices x 2 halves of 16 keys, one tile
 * each) then `steps` V parts (D/16 slices of 16 dims, one tile each). */
INLINE int64_t kv_buf_u16(int steps, int D) { return (int64_t)steps * 2 * D * 32; }

static const uint16_t zero_row[256] __attribute__((aligned(64)));

static void lay_out_keys(const Step *s, int layer, int row, int kh, const Chunk *c, uint16_t *buf) {
    const int D = s->head_dim;
    const int64_t part = (int64_t)D * 32; /* uint16 of one step's K (or V) tiles */
    uint16_t *kb = buf, *vb = buf + (int64_t)c->steps * part;
    RowIter ki, vi;
    rows_init(&ki, s, layer, row, kh, 0, 0);
    rows_init(&vi, s, layer, row, kh, 1, 0);
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                        36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int st = 0; st < c->steps; st++) {
        const char *kp[KS], *vp[KS];
        for (int i = 0; i < KS; i++) {
            const int j = st * KS + i;
            kp[i] = j < c->n ? (const char *)rows_next(&ki) : (const char *)zero_row;
            vp[i] = j < c->n ? (const char *)rows_next(&vi) : (const char *)zero_row;
        }
        /* K: for each half of 16 keys, kt[p] = head-dim pair p of the 16 keys; slice d32 of the
         * head is pairs [16 d32, 16 d32 + 16): one B tile of Q K^T. */
        for (int half = 0; half < 2; half++) {
            __m512i kt[128] __attribute__((aligned(64)));
            transpose_tile(kp + 16 * half, D, kt);
            for (int d32 = 0; d32 < D / 32; d32++)
                memcpy(kb + (int64_t)st * part + ((int64_t)d32 * 2 + half) * TILE_U16, kt + 16 * d32, 1024);
        }
        /* V: row r of slice e = (v[2r][16e + i], v[2r + 1][16e + i]) for i < 16: one B tile of P V. */
        uint16_t *vs = vb + (int64_t)st * part;
        for (int r = 0; r < KS / 2; r++)
            for (int d32 = 0; d32 < D / 32; d32++) {
                const __m512i x = _mm512_loadu_si512((const uint16_t *)vp[2 * r] + 32 * d32);
                const __m512i y = _mm512_loadu_si512((const uint16_t *)vp[2 * r + 1] + 32 * d32);
                _mm512_storeu_si512(vs + (int64_t)(2 * d32) * TILE_U16 + 32 * r, _mm512_permutex2var_epi16(x, lo, y));
                _mm512_storeu_si512(vs + (int64_t)(2 * d32 + 1) * TILE_U16 + 32 * r, _mm512_permutex2var_epi16(x, hi, y));
            }
    }
}

typedef struct {
    uint16_t *qb; /* [QR][D] bf16, zero-padded rows */
    float *o; /* [QR][D] fp32 accumulator */
    float *sc; /* [QR][KS] scores */
    uint16_t *p; /* [QR][KS] bf16 weights */
} Work;

/* A row's scores may exceed the max its weights are taken against by up to TAU before the
 * accumulator is rescaled (weights up to e^8 ~ 3e3: far inside fp32 and bf16's range). With the
 * exact running max nearly every step rescales some row, which costs a round trip of the output
 * tiles through memory; with the margin, a step rarely does. */
#define TAU 8.0f

/* O slice j (16 head dims) lives in tile 4 + j; tile numbers are immediates. */
INLINE void o_load(int j, const float *p, int stride) {
    switch (j) {
    case 0: _tile_loadd(4, p, stride); break;
    case 1: _tile_loadd(5, p, stride); break;
    case 2: _tile_loadd(6, p, stride); break;
    default: _tile_loadd(7, p, stride); break;
    }
}
INLINE void o_store(int j, float *p, int stride) {
    switch (j) {
    case 0: _tile_stored(4, p, stride); break;
    case 1: _tile_stored(5, p, stride); break;
    case 2: _tile_stored(6, p, stride); break;
    default: _tile_stored(7, p, stride); break;
    }
}
INLINE void o_dp(int j) { /* O slice j += P (tile 0) x V slice (tile 1) */
    switch (j) {
    case 0: _tile_dpbf16ps(4, 0, 1); break;
    case 1: _tile_dpbf16ps(5, 0, 1); break;
    case 2: _tile_dpbf16ps(6, 0, 1); break;
    default: _tile_dpbf16ps(7, 0, 1); break;
    }
}

/* S of one 32-key step into tiles 2 (keys 0..15) and 3 (16..31): Q slices in tile 0, K in 1. */
INLINE void scores_issue(const uint16_t *qb, const uint16_t *kstep, int D) {
    _tile_zero(2);
    _tile_zero(3);
    for (int d32 = 0; d32 < D / 32; d32++) {
        _tile_loadd(0, qb + 32 * d32, 2 * D);
        _tile_loadd(1, kstep + (int64_t)(2 * d32) * TILE_U16, 64);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kstep + (int64_t)(2 * d32 + 1) * TILE_U16, 64);
        _tile_dpbf16ps(3, 0, 1);
    }
}

/* The online softmax of one step's scores (w->sc) into bf16 weights (w->p); alpha[r]: the factor
 * row r's accumulator and sum take (1: none). Returns whether an accumulator already holding
 * sums must be rescaled. */
static int softmax_step(const Work *w, int j0, const int *nr, float *m, float *l, float *alpha, __m512 scale) {
    int need = 0;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < QR; r++) {
        uint16_t *pr = w->p + r * KS;
        const int valid = nr[r] - j0; /* keys of this step the row sees */
        alpha[r] = 1.0f;
        if (valid <= 0) { /* done (or a padding row): weight 0 for these keys */
            _mm512_storeu_si512(pr, _mm512_setzero_si512());
            continue;
        }
        const __mmask16 k0 = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
        const __mmask16 k1 = valid >= 32 ? 0xffff : valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1);
        const __m512 x0 = _mm512_mask_mul_ps(ninf, k0, _mm512_loadu_ps(w->sc + r * KS), scale);
        const __m512 x1 = _mm512_mask_mul_ps(ninf, k1, _mm512_loadu_ps(w->sc + r * KS + 16), scale);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
        if (mx > m[r] + TAU) { /* -inf on the row's first step: its accumulator is still 0 */
            if (m[r] != -INFINITY) alpha[r] = expf(m[r] - mx), need = 1;
            else alpha[r] = 0.0f;
            m[r] = mx;
        }
        const __m512 vm = _mm512_set1_ps(m[r]);
        const __m256i h0 = cvt16_bf16(_mm512_maskz_mov_ps(k0, exp512(_mm512_sub_ps(x0, vm))));
        const __m256i h1 = cvt16_bf16(_mm512_maskz_mov_ps(k1, exp512(_mm512_sub_ps(x1, vm))));
        _mm256_storeu_si256((__m256i *)pr, h0);
        _mm256_storeu_si256((__m256i *)(pr + 16), h1);
        const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h0), 16)),
                                         _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h1), 16)));
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    return need;
}

/* Rows [16 b, 16 b + 16) of chunk c, query head h (of kv head kh). Software-pipelined: step
 * st + 1's scores are issued on the tiles before step st's softmax runs on the vector units, so
 * the two overlap. With head_dim 64 the output accumulator stays in tiles 4..7 for the whole key
 * walk (it only goes through memory for a rescale); otherwise it lives in w->o and passes through
 * tiles 4..7 four 16-dim slices at a time. */
static void attend_rows(const Step *s, const Chunk *c, const uint16_t *buf, int b, int h, const void *q,
                        int64_t q_stride, void *out, int64_t out_stride, int first, const Work *w) {
    const int D = s->head_dim, t0 = c->t0 + QR * b, nsl = D / 16, in_tiles = nsl == 4;
    const int rows = c->len - QR * b < QR ? c->len - QR * b : QR;
    const int n = s->ctx_lens[t0 + rows - 1]; /* keys the last row sees */
    const int steps = (n + KS - 1) / KS;
    const int64_t part = (int64_t)D * 32;
    const uint16_t *kb = buf, *vb = buf + (int64_t)c->steps * part;
    for (int r = 0; r < QR; r++) {
        if (r < rows) memcpy(w->qb + r * D, (const uint16_t *)q + (int64_t)(t0 + r) * q_stride + (int64_t)h * D, 2 * D);
        else memset(w->qb + r * D, 0, 2 * D);
    }
    memset(w->o, 0, sizeof(float) * QR * D);
    if (in_tiles)
        for (int j = 0; j < 4; j++) o_load(j, w->o + 16 * j, 4 * D);
    float m[QR], l[QR], alpha[QR];
    int nr[QR];
    for (int r = 0; r < QR; r++) m[r] = -INFINITY, l[r] = 0.0f, nr[r] = r < rows ? s->ctx_lens[t0 + r] : 0;
    const __m512 scale = _mm512_set1_ps(s->scale);
    scores_issue(w->qb, kb, D);
    for (int st = 0; st < steps; st++) {
        _tile_stored(2, w->sc, 4 * KS);
        _tile_stored(3, w->sc + 16, 4 * KS);
        if (st + 1 < steps) scores_issue(w->qb, kb + (int64_t)(st + 1) * part, D);
        if (softmax_step(w, st * KS, nr, m, l, alpha, scale)) {
            if (in_tiles)
                for (int j = 0; j < 4; j++) o_store(j, w->o + 16 * j, 4 * D);
            for (int r = 0; r < QR; r++) {
                if (alpha[r] == 1.0f) continue;
                const __m512 va = _mm512_set1_ps(alpha[r]);
                float *orow = w->o + r * D;
                for (int d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
            }
            if (in_tiles)
                for (int j = 0; j < 4; j++) o_load(j, w->o + 16 * j, 4 * D);
        }
        _tile_loadd(0, w->p, 2 * KS);
        const uint16_t *vs = vb + (int64_t)st * part;
        for (int e0 = 0; e0 < nsl; e0 += 4) {
            const int cnt = nsl - e0 < 4 ? nsl - e0 : 4;
            if (!in_tiles)
                for (int j = 0; j < cnt; j++) o_load(j, w->o + 16 * (e0 + j), 4 * D);
            for (int j = 0; j < cnt; j++) {
                _tile_loadd(1, vs + (int64_t)(e0 + j) * TILE_U16, 64);
                o_dp(j);
            }
            if (!in_tiles)
                for (int j = 0; j < cnt; j++) o_store(j, w->o + 16 * (e0 + j), 4 * D);
        }
    }
    if (in_tiles)
        for (int j = 0; j < 4; j++) o_store(j, w->o + 16 * j, 4 * D);
    for (int r = 0; r < rows; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        uint16_t *orow = (uint16_t *)out + (int64_t)(t0 + r - first) * out_stride + (int64_t)h * D;
        for (int d = 0; d < D; d += 16) store16(orow, d, _mm512_mul_ps(_mm512_loadu_ps(w->o + r * D + d), inv), 1);
    }
}

int prefill_attention_amx(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q,
                          int64_t q_stride, void *out, int64_t out_stride) {
    const int D = s->head_dim, KVH = s->num_kv_heads, H = s->num_heads, G = H / KVH;
    if (!s->bf16 || s->kv_int8 || D % 32 != 0 || D > 256 || s->window != 0 || count <= 0 || !amx_permitted()) return 1;
    /* chunks: runs of tokens of one sequence at consecutive positions */
    Chunk *ch = (Chunk *)malloc(sizeof(Chunk) * (size_t)count);
    if (!ch) return 1;
    int nc = 0;
    int64_t total = 0;
    for (int t = first; t < first + count; t++) {
        if (nc && s->token_row[t] == s->token_row[t - 1] && s->positions[t] == s->positions[t - 1] + 1) {
            ch[nc - 1].len++;
            continue;
        }
        ch[nc++] = (Chunk){t, 1, 0, 0, 0, 0};
    }
    int64_t items = 0;
    for (int i = 0; i < nc; i++) {
        ch[i].n = s->ctx_lens[ch[i].t0 + ch[i].len - 1];
        ch[i].steps = (ch[i].n + KS - 1) / KS;
        ch[i].blocks = (ch[i].len + QR - 1) / QR;
        ch[i].buf = total;
        total += KVH * kv_buf_u16(ch[i].steps, D);
        items += (int64_t)ch[i].blocks * H;
    }
    uint16_t *buf = (uint16_t *)aligned_alloc(64, (size_t)total * 2 + 64);
    if (!buf) {
        free(ch);
        return 1;
    }
    int fail = 0;
#pragma omp parallel
    {
        Work w;
        w.qb = (uint16_t *)aligned_alloc(64, (size_t)QR * D * 2);
        w.o = (float *)aligned_alloc(64, sizeof(float) * QR * D);
        w.sc = (float *)aligned_alloc(64, sizeof(float) * QR * KS);
        w.p = (uint16_t *)aligned_alloc(64, (size_t)QR * KS * 2);
        const int ok = w.qb && w.o && w.sc && w.p;
        if (!ok) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < (int64_t)nc * KVH; i++) {
            const Chunk *c = ch + i / KVH;
            const int kh = (int)(i % KVH);
            lay_out_keys(s, layer, s->token_row[c->t0], kh, c, buf + c->buf + kh * kv_buf_u16(c->steps, D));
        }
        if (ok) amx_configure_16x64();
        /* Items in reverse: a chunk's last rows see the most keys (better balance). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = items - 1; it >= 0; it--) {
            if (!ok) continue;
            int64_t rest = it;
            int ci = 0;
            while (rest >= (int64_t)ch[ci].blocks * H) rest -= (int64_t)ch[ci].blocks * H, ci++;
            const int b = (int)(rest / H), h = (int)(rest % H), kh = h / G;
            attend_rows(s, ch + ci, buf + ch[ci].buf + kh * kv_buf_u16(ch[ci].steps, D), b, h, q, q_stride, out,
                        out_stride, first, &w);
        }
        if (ok) _tile_release();
        free(w.qb);
        free(w.o);
        free(w.sc);
        free(w.p);
    }
    free(buf);
    free(ch);
    return fail; /* 1: a work buffer could not be allocated; the caller takes the other path */
}

#else
int prefill_attention_amx(const Step *s, int32_t layer, int32_t first, int32_t count, const void *q,
                          int64_t q_stride, void *out, int64_t out_stride) {
    (void)s, (void)layer, (void)first, (void)count, (void)q, (void)q_stride, (void)out, (void)out_stride;
    return 1;
}
#endif
