/* Native dequantization for the hot path of a hit: cachestore/kernels.py is its only caller and checks every
 * tensor it hands over (dtypes, shapes, strides; all from live torch tensors, so every address is in bounds).
 *
 * int8 codes times their fp16 scales, and int4 codes (two a byte, low nibble first) times their fp16 scales plus
 * their fp16 offsets, into fp32 (the transformers context) or fp16 (llama.cpp's sequence state), in one pass: torch
 * unpacks, converts, then scales and offsets in passes of their own over the output, and reaches fp16 only through an
 * fp32 temporary. The product is exact in fp32 (8- or 4-bit codes, 11-bit scales), the sum rounded once, and fp16 rounded once more, to nearest even: the very values torch
 * computes. x86-64 with AVX-512F, or AVX2 and F16C, chosen once at import; elsewhere `level` is 0 and the caller uses
 * torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_X86 1
#endif

typedef struct {
    long n[3];       /* outer sizes */
    long d;          /* inner size: a multiple of 16, contiguous in the output and the codes */
    long os[3];      /* output strides (elements) */
    long qs[3];      /* code strides */
    long ss[3];      /* scale strides (0 where broadcast) */
    long sd;         /* the scale's inner stride: 0 (one per row) or 1 (one per column) */
} Shape;

typedef struct {
    long n[4];       /* outer sizes: planes n[0] x n[1], each of n[2] x n[3] rows */
    long f;          /* row length: a multiple of 16, contiguous in the output and the codes */
    long os[4];      /* output strides (elements) */
    long cs[4];      /* code strides, in codes (even: every row starts on a byte) */
    long ss[4];      /* scale and offset strides (0 where broadcast) */
    long sf;         /* their inner stride: 0 (one per row) or 1 (one per column) */
} Shape4;

#ifdef KV_X86
/* The rows of a Shape, for both instruction sets: the row (__VA_ARGS__) sees `o`, its first output element, `qr`,
 * its codes, and `sr`, its scales. */
#define INT8_ROWS(g, q, s, ...)                                                                        \
    for (long a = 0; a < (g)->n[0]; a++)                                                               \
    for (long b = 0; b < (g)->n[1]; b++)                                                               \
    for (long t = 0; t < (g)->n[2]; t++) {                                                             \
        long o = a * (g)->os[0] + b * (g)->os[1] + t * (g)->os[2];                                     \
        const int8_t *qr = (q) + a * (g)->qs[0] + b * (g)->qs[1] + t * (g)->qs[2];                     \
        const uint16_t *sr = (s) + a * (g)->ss[0] + b * (g)->ss[1] + t * (g)->ss[2];                   \
        __VA_ARGS__                                                                                    \
    }

/* The rows of a Shape4, for both instruction sets: the row (__VA_ARGS__) sees `o`, its first output element, `cr`,
 * its packed codes, `ci`, the index of its first code, and `at`, its first scale and offset. */
#define INT4_ROWS(g, codes, ...)                                                                       \
    for (long a = 0; a < (g)->n[0]; a++)                                                               \
    for (long b = 0; b < (g)->n[1]; b++)                                                               \
    for (long c = 0; c < (g)->n[2]; c++)                                                               \
    for (long e = 0; e < (g)->n[3]; e++) {                                                             \
        long o = a * (g)->os[0] + b * (g)->os[1] + c * (g)->os[2] + e * (g)->os[3];                    \
        long ci = a * (g)->cs[0] + b * (g)->cs[1] + c * (g)->cs[2] + e * (g)->cs[3];                   \
        const uint8_t *cr = (codes) + ci / 2;                                                          \
        long at = a * (g)->ss[0] + b * (g)->ss[1] + c * (g)->ss[2] + e * (g)->ss[3];                   \
        __VA_ARGS__                                                                                    \
    }

/* 16 (AVX-512) or 8 (AVX2) values to out[o], as fp16 (rounded to nearest even) when `half`, else fp32. */
__attribute__((target("avx512f"))) static inline void store16(char *out, int half, long o, __m512 x) {
    if (half)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + o),
                            _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm512_storeu_ps((float *)out + o, x);
}

__attribute__((target("avx2,f16c"))) static inline void store8(char *out, int half, long o, __m256 x) {
    if (half)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + o),
                         _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm256_storeu_ps((float *)out + o, x);
}

__attribute__((target("avx512f"))) static void int8_avx512(char *out, int half, const int8_t *q, const uint16_t *s,
                                                            const Shape *g) {
    INT8_ROWS(g, q, s,
        __m512 row = _mm512_cvtph_ps(_mm256_set1_epi16((short)sr[0]));
        for (long d = 0; d < g->d; d += 16) {
            __m512 scale = g->sd ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sr + d))) : row;
            __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qr + d)));
            store16(out, half, o + d, _mm512_mul_ps(_mm512_cvtepi32_ps(codes), scale));
        })
}

__attribute__((target("avx2,f16c"))) static void int8_avx2(char *out, int half, const int8_t *q, const uint16_t *s,
                                                           const Shape *g) {
    INT8_ROWS(g, q, s,
        __m256 row = _mm256_cvtph_ps(_mm_set1_epi16((short)sr[0]));
        for (long d = 0; d < g->d; d += 8) {
            __m256 scale = g->sd ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sr + d))) : row;
            __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qr + d)));
            store8(out, half, o + d, _mm256_mul_ps(_mm256_cvtepi32_ps(codes), scale));
        })
}

/* One row of 16 int4 codes from 8 bytes: byte i holds code 2i (low nibble) and 2i + 1 (high). */
__attribute__((target("avx512f"))) static void int4_avx512(char *out, int half, const uint8_t *codes,
                                                            const uint16_t *s, const uint16_t *z, const Shape4 *g) {
    const __m128i low = _mm_set1_epi8(0x0F);
    INT4_ROWS(g, codes,
        __m512 srow = _mm512_cvtph_ps(_mm256_set1_epi16((short)s[at]));
        __m512 zrow = _mm512_cvtph_ps(_mm256_set1_epi16((short)z[at]));
        for (long d = 0; d < g->f; d += 16) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(cr + d / 2));
            __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(bytes, low),
                                              _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
            __m512 scale = g->sf ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + at + d))) : srow;
            __m512 zero = g->sf ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(z + at + d))) : zrow;
            __m512i v = _mm512_cvtepu8_epi32(pairs);
            store16(out, half, o + d, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), scale), zero));
        })
}

__attribute__((target("avx2,f16c"))) static void int4_avx2(char *out, int half, const uint8_t *codes,
                                                           const uint16_t *s, const uint16_t *z, const Shape4 *g) {
    const __m128i low = _mm_set1_epi8(0x0F);
    INT4_ROWS(g, codes,
        __m256 srow = _mm256_cvtph_ps(_mm_set1_epi16((short)s[at]));
        __m256 zrow = _mm256_cvtph_ps(_mm_set1_epi16((short)z[at]));
        for (long d = 0; d < g->f; d += 8) {
            int32_t four;
            memcpy(&four, cr + d / 2, 4);
            __m128i bytes = _mm_cvtsi32_si128(four);
            __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(bytes, low),
                                              _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
            __m256 scale = g->sf ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + at + d))) : srow;
            __m256 zero = g->sf ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(z + at + d))) : zrow;
            __m256i v = _mm256_cvtepu8_epi32(pairs);
            store8(out, half, o + d, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), scale), zero));
        })
}

/* Attention over KV still in its codes (cachestore/attend.py): a hit's first forward step reads the landed frames
 * where they lie instead of a dequantized copy. For each frame `a` and kv head `h`, its `m` queries (the query heads
 * that share the kv head, times the new tokens) against the frame's rows: scores, q . k, and weighted values,
 * out += sum p v. Codes are int8 (times a scale), int4 (times a scale, plus an offset), or fp16 / fp32 values. Each
 * element of k and v is the very value cachestore.quant dequantizes to, used in a register and never stored; the
 * sums are fp32, in another order than torch's. Keys are scaled per column, one scale a group of `group` rows;
 * values per row, one scale a group of `group` columns. */
typedef struct {
    long n[3];    /* frames, kv heads, rows (tokens) a frame */
    long d;       /* row length (head dim): a multiple of 16, up to 256 */
    long m;       /* queries per kv head */
    long group;   /* keys: the rows a scale covers; values: the columns (a multiple of 16) */
    long cs[3];   /* code strides (frame, head, row), in codes (int4: even); rows contiguous */
    long ss[3];   /* scale and offset strides (frame, head, key group or value row); key scales contiguous */
    long qs[2];   /* query (scores) or output (values) strides (head, query); rows contiguous */
    long ps[3];   /* scores or weights strides (head, query, frame); a frame's rows contiguous */
} Attend;

#define QUERIES 4 /* queries a pass over a frame's rows, each with its accumulators in registers */

/* Each instruction set's vector of L floats (vec16: AVX-512, vec8: AVX2) and the operations the passes use on it:
 * codesL(codes, i, bits), L codes from code index i on as floats (int8; int4, two a byte, low nibble first; fp16;
 * fp32); halfL(p), L fp16 values; half1xL(x), one fp16 value in every lane; sumL(x), the sum of its lanes. */
typedef __m512 vec16;
typedef __m256 vec8;
#define AVX512 __attribute__((target("avx512f"), always_inline)) static inline
#define AVX2 __attribute__((target("avx2,f16c,fma"), always_inline)) static inline

AVX512 vec16 codes16(const void *codes, long i, int bits) {
    if (bits == 32)
        return _mm512_loadu_ps((const float *)codes + i);
    if (bits == 16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)codes + i)));
    if (bits == 8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)codes + i))));
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)codes + i / 2));
    __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pairs));
}
AVX512 vec16 half16(const uint16_t *x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x)); }
AVX512 vec16 half1x16(uint16_t x) { return _mm512_cvtph_ps(_mm256_set1_epi16((short)x)); }
AVX512 float sum16(vec16 x) { return _mm512_reduce_add_ps(x); }
AVX512 vec16 zero16(void) { return _mm512_setzero_ps(); }
AVX512 vec16 set16(float x) { return _mm512_set1_ps(x); }
AVX512 vec16 load16(const float *p) { return _mm512_loadu_ps(p); }
AVX512 void keep16(float *p, vec16 x) { _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), x)); }
AVX512 vec16 mul16(vec16 x, vec16 y) { return _mm512_mul_ps(x, y); }
AVX512 vec16 add16(vec16 x, vec16 y) { return _mm512_add_ps(x, y); }
AVX512 vec16 fma16(vec16 x, vec16 y, vec16 z) { return _mm512_fmadd_ps(x, y, z); }

AVX2 vec8 codes8(const void *codes, long i, int bits) {
    if (bits == 32)
        return _mm256_loadu_ps((const float *)codes + i);
    if (bits == 16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)codes + i)));
    if (bits == 8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)codes + i))));
    const __m128i low = _mm_set1_epi8(0x0F);
    int32_t four;
    memcpy(&four, (const uint8_t *)codes + i / 2, 4);
    __m128i bytes = _mm_cvtsi32_si128(four);
    __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pairs));
}
AVX2 vec8 half8(const uint16_t *x) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x)); }
AVX2 vec8 half1x8(uint16_t x) { return _mm256_cvtph_ps(_mm_set1_epi16((short)x)); }
AVX2 float sum8(vec8 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
AVX2 vec8 zero8(void) { return _mm256_setzero_ps(); }
AVX2 vec8 set8(float x) { return _mm256_set1_ps(x); }
AVX2 vec8 load8(const float *p) { return _mm256_loadu_ps(p); }
AVX2 void keep8(float *p, vec8 x) { _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), x)); }
AVX2 vec8 mul8(vec8 x, vec8 y) { return _mm256_mul_ps(x, y); }
AVX2 vec8 add8(vec8 x, vec8 y) { return _mm256_add_ps(x, y); }
AVX2 vec8 fma8(vec8 x, vec8 y, vec8 z) { return _mm256_fmadd_ps(x, y, z); }

/* The (frame, head, query group) passes: the pass (__VA_ARGS__) sees `at`, the code index of the frame's first row
 * for head h, `sf`, the index of its first scale, and `qn`, how many of the queries m0 .. m0 + QUERIES - 1 are real;
 * it runs `body(qn, ...)` with qn a constant, so the accumulators of each query stay in registers. */
#define ATTEND_PASSES(g, body, ...)                                                                    \
    for (long a = 0; a < (g)->n[0]; a++)                                                               \
    for (long h = 0; h < (g)->n[1]; h++)                                                               \
    for (long m0 = 0; m0 < (g)->m; m0 += QUERIES) {                                                    \
        long at = a * (g)->cs[0] + h * (g)->cs[1], sf = a * (g)->ss[0] + h * (g)->ss[1];               \
        switch ((g)->m - m0 < QUERIES ? (g)->m - m0 : QUERIES) {                                       \
        case 1: body(1, __VA_ARGS__); break;                                                           \
        case 2: body(2, __VA_ARGS__); break;                                                           \
        case 3: body(3, __VA_ARGS__); break;                                                           \
        default: body(4, __VA_ARGS__); break;                                                          \
        }                                                                                              \
    }

/* The passes of one instruction set (its vectors of L floats, ISA its inline attribute; values take K vectors of
 * columns at a time): scoresL and valuesL, for `bits` a constant where they are inlined. */
#define ATTEND_KERNELS(L, ISA, K)                                                                      \
ISA void score_rows##L(int qn, float *p, const float *q, long h, long m0, const void *codes, long at,  \
                       const uint16_t *s, const uint16_t *z, long sf, const Attend *g, long a, int bits) {    \
    const float *qj[QUERIES];                                                                          \
    for (int j = 0; j < qn; j++)                                                                       \
        qj[j] = q + h * g->qs[0] + (m0 + j) * g->qs[1];                                                \
    float *pa = p + h * g->ps[0] + m0 * g->ps[1] + a * g->ps[2];                                       \
    for (long t0 = 0; t0 < g->n[2]; t0 += g->group) {                                                  \
        long t1 = t0 + g->group < g->n[2] ? t0 + g->group : g->n[2], row = at + t0 * g->cs[2];         \
        long sr = sf + t0 / g->group * g->ss[2];                                                       \
        for (long t = t0; t < t1; t++, row += g->cs[2]) {                                              \
            vec##L acc[QUERIES];                                                                       \
            for (int j = 0; j < qn; j++)                                                               \
                acc[j] = zero##L();                                                                    \
            for (long d = 0; d < g->d; d += L) {                                                       \
                vec##L k = codes##L(codes, row + d, bits);                                             \
                if (bits <= 8)                                                                         \
                    k = mul##L(k, half##L(s + sr + d));                                                \
                if (bits == 4)                                                                         \
                    k = add##L(k, half##L(z + sr + d));                                                \
                for (int j = 0; j < qn; j++)                                                           \
                    acc[j] = fma##L(load##L(qj[j] + d), k, acc[j]);                                    \
            }                                                                                          \
            for (int j = 0; j < qn; j++)                                                               \
                pa[j * g->ps[1] + t] = sum##L(acc[j]);                                                 \
        }                                                                                              \
    }                                                                                                  \
}                                                                                                      \
ISA void scores##L(float *p, const float *q, const void *codes, const uint16_t *s, const uint16_t *z,  \
                   const Attend *g, int bits) {                                                        \
    ATTEND_PASSES(g, score_rows##L, p, q, h, m0, codes, at, s, z, sf, g, a, bits)                      \
}                                                                                                      \
/* Columns d0 .. d0 + k L - 1 of a values pass (k a constant where inlined). */                        \
ISA void value_columns##L(float *o, const float *p, long h, long m0, int qn, const void *codes, long row, \
                          const uint16_t *s, const uint16_t *z, long sr, const Attend *g, long a, long d0,   \
                          int k, int bits) {                                                           \
    const float *pj[QUERIES];                                                                          \
    for (int j = 0; j < qn; j++)                                                                       \
        pj[j] = p + h * g->ps[0] + (m0 + j) * g->ps[1] + a * g->ps[2];                                 \
    vec##L acc[QUERIES][K];                                                                            \
    long c[K];                                                                                         \
    for (int i = 0; i < k; i++)                                                                        \
        c[i] = (d0 + L * i) / g->group;                                                                \
    for (int j = 0; j < qn; j++)                                                                       \
        for (int i = 0; i < k; i++)                                                                    \
            acc[j][i] = zero##L();                                                                     \
    for (long t = 0; t < g->n[2]; t++, row += g->cs[2], sr += g->ss[2]) {                              \
        vec##L v[K];                                                                                   \
        for (int i = 0; i < k; i++) {                                                                  \
            v[i] = codes##L(codes, row + d0 + L * i, bits);                                            \
            if (bits <= 8)                                                                             \
                v[i] = mul##L(v[i], half1x##L(s[sr + c[i]]));                                          \
            if (bits == 4)                                                                             \
                v[i] = add##L(v[i], half1x##L(z[sr + c[i]]));                                          \
        }                                                                                              \
        for (int j = 0; j < qn; j++) {                                                                 \
            vec##L w = set##L(pj[j][t]);                                                               \
            for (int i = 0; i < k; i++)                                                                \
                acc[j][i] = fma##L(w, v[i], acc[j][i]);                                                \
        }                                                                                              \
    }                                                                                                  \
    for (int j = 0; j < qn; j++)                                                                       \
        for (int i = 0; i < k; i++)                                                                    \
            keep##L(o + h * g->qs[0] + (m0 + j) * g->qs[1] + d0 + L * i, acc[j][i]);                   \
}                                                                                                      \
ISA void value_rows##L(int qn, float *o, const float *p, long h, long m0, const void *codes, long at,   \
                       const uint16_t *s, const uint16_t *z, long sf, const Attend *g, long a, int bits) {    \
    long d0 = 0;                                                                                       \
    for (; d0 + K * L <= g->d; d0 += K * L)                                                            \
        value_columns##L(o, p, h, m0, qn, codes, at, s, z, sf, g, a, d0, K, bits);                     \
    for (; d0 < g->d; d0 += L)                                                                         \
        value_columns##L(o, p, h, m0, qn, codes, at, s, z, sf, g, a, d0, 1, bits);                     \
}                                                                                                      \
ISA void values##L(float *o, const float *p, const void *codes, const uint16_t *s, const uint16_t *z,  \
                   const Attend *g, int bits) {                                                        \
    ATTEND_PASSES(g, value_rows##L, o, p, h, m0, codes, at, s, z, sf, g, a, bits)                      \
}

ATTEND_KERNELS(16, AVX512, 4)
ATTEND_KERNELS(8, AVX2, 2)

/* The entry points: each instruction set, each code width, scores and values (`bits` a constant in each). */
typedef void Pass(float *, const float *, const void *, const uint16_t *, const uint16_t *, const Attend *);
#define ATTEND_ENTRY(name, body, isa, bits)                                                            \
    __attribute__((target(isa))) static void name(float *o, const float *x, const void *c,          \
                                                     const uint16_t *s, const uint16_t *z, const Attend *g) { \
        body(o, x, c, s, z, g, bits);                                                                  \
    }
ATTEND_ENTRY(scores8_avx512, scores16, "avx512f", 8)
ATTEND_ENTRY(scores4_avx512, scores16, "avx512f", 4)
ATTEND_ENTRY(scores16_avx512, scores16, "avx512f", 16)
ATTEND_ENTRY(scores32_avx512, scores16, "avx512f", 32)
ATTEND_ENTRY(values8_avx512, values16, "avx512f", 8)
ATTEND_ENTRY(values4_avx512, values16, "avx512f", 4)
ATTEND_ENTRY(values16_avx512, values16, "avx512f", 16)
ATTEND_ENTRY(values32_avx512, values16, "avx512f", 32)
ATTEND_ENTRY(scores8_avx2, scores8, "avx2,f16c,fma", 8)
ATTEND_ENTRY(scores4_avx2, scores8, "avx2,f16c,fma", 4)
ATTEND_ENTRY(scores16_avx2, scores8, "avx2,f16c,fma", 16)
ATTEND_ENTRY(scores32_avx2, scores8, "avx2,f16c,fma", 32)
ATTEND_ENTRY(values8_avx2, values8, "avx2,f16c,fma", 8)
ATTEND_ENTRY(values4_avx2, values8, "avx2,f16c,fma", 4)
ATTEND_ENTRY(values16_avx2, values8, "avx2,f16c,fma", 16)
ATTEND_ENTRY(values32_avx2, values8, "avx2,f16c,fma", 32)
static Pass *const passes[2][2][4] = { /* [level - 1][values][int8, int4, fp16, fp32] */
    {{scores8_avx2, scores4_avx2, scores16_avx2, scores32_avx2}, {values8_avx2, values4_avx2, values16_avx2, values32_avx2}},
    {{scores8_avx512, scores4_avx512, scores16_avx512, scores32_avx512},
     {values8_avx512, values4_avx512, values16_avx512, values32_avx512}},
};
#endif

static int detected = 0; /* 2: AVX-512F, 1: AVX2 + F16C + FMA, 0: none (the caller uses torch) */
static int level = 0;    /* the one in use: `detected`, or less (`use`, for tests) */

#define STAGE_ELEMENTS 8192 /* 16 KiB of fp16: the longest token row this takes (`stage_elements`) */

#ifdef KV_X86
/* int8 into fp16 rows that lie one after another for each outer index (llama.cpp's sequence state: a layer's K or V,
 * each token's heads side by side), past the cache. A hit's state is tens of MB that nothing reads before llama.cpp
 * copies it, and an ordinary store first reads each line it overwrites from memory (2048 SmolLM2 tokens, 47 MB,
 * caches cold: 8.1 ms with ordinary stores, 5.4 streamed). A few tokens at a time (GROUP_BYTES) are dequantized
 * into a staging buffer in L1 and their whole lines streamed out with non-temporal stores before the next few are
 * computed: the write-combining buffers drain while the next group is computed. Staging 16 KiB at a time instead
 * left the core idle while they drained: on an Intel Xeon VM 32 frames of a 2048-token hit took 6.1 ms warm and 8.2
 * cold that way, against 5.0 and 6.7. The bytes are the same. */

#define GROUP_BYTES 768 /* ~ the lines a core's write-combining buffers hold: computed, then streamed out */

/* The whole lines among the `*have` staged bytes, which belong at dst + *done on, streamed out (the partial line
 * before dst's first whole line stored as usual); what is left of a line moved to the stage's front. */
__attribute__((target("avx512f"))) static void drain_avx512(char *dst, long *done, char *stage, long *have) {
    long at = (long)((64 - ((uintptr_t)(dst + *done) & 63)) & 63);
    if (at > *have)
        return; /* not up to a line's start yet: the next group gets there */
    memcpy(dst + *done, stage, (size_t)at);
    for (; at + 64 <= *have; at += 64)
        _mm512_stream_si512((__m512i *)(dst + *done + at), _mm512_loadu_si512((const void *)(stage + at)));
    *done += at;
    memmove(stage, stage + at, (size_t)(*have - at));
    *have -= at;
}

__attribute__((target("avx2"))) static void drain_avx2(char *dst, long *done, char *stage, long *have) {
    long at = (long)((32 - ((uintptr_t)(dst + *done) & 31)) & 31);
    if (at > *have)
        return;
    memcpy(dst + *done, stage, (size_t)at);
    for (; at + 32 <= *have; at += 32)
        _mm256_stream_si256((__m256i *)(dst + *done + at), _mm256_loadu_si256((const __m256i *)(stage + at)));
    *done += at;
    memmove(stage, stage + at, (size_t)(*have - at));
    *have -= at;
}

/* Token t of outer index a goes to out + a * out_a + t * row, row = g->n[1] * g->d elements (g's os are not read):
 * each outer index's tokens are one run of bytes, streamed out group by group, its last partial line stored as
 * usual. */
static void int8_rows_streamed(uint16_t *out, long out_a, const int8_t *q, const uint16_t *s, const Shape *g) {
    _Alignas(64) char stage[STAGE_ELEMENTS * 2 + 128]; /* a group (one row at least) and a partial line before it */
    long row = g->n[1] * g->d, per = GROUP_BYTES / (2 * row) > 0 ? GROUP_BYTES / (2 * row) : 1;
    for (long a = 0; a < g->n[0]; a++) {
        char *dst = (char *)(out + a * out_a);
        long done = 0, have = 0;
        for (long t0 = 0; t0 < g->n[2]; t0 += per) {
            Shape part = *g;
            part.n[0] = 1;
            part.n[2] = g->n[2] - t0 < per ? g->n[2] - t0 : per;
            part.os[0] = 0, part.os[1] = g->d, part.os[2] = row;
            const int8_t *qa = q + a * g->qs[0] + t0 * g->qs[2];
            const uint16_t *sa = s + a * g->ss[0] + t0 * g->ss[2];
            if (level == 2) {
                int8_avx512(stage + have, 1, qa, sa, &part);
                have += part.n[2] * row * 2;
                drain_avx512(dst, &done, stage, &have);
            } else {
                int8_avx2(stage + have, 1, qa, sa, &part);
                have += part.n[2] * row * 2;
                drain_avx2(dst, &done, stage, &have);
            }
        }
        memcpy(dst + done, stage, (size_t)have);
    }
}
#endif

/* The kernels run on the calling thread, without the GIL. Threads of their own were measured and dropped: beside
 * torch's OpenMP workers, which spin for a while after each of the forward step's parallel regions, a second kernel
 * thread made an hf hit of 8128 tokens slower (int8: 1.29 -> 1.65 of the floor), though alone it was faster. */
static PyObject *int8(PyObject *self, PyObject *args) {
    unsigned long long out, q, s;
    int half;
    Shape shape, *g = &shape;
    (void)self;
    if (!PyArg_ParseTuple(args, "KpKK(llll)(lll)(lll)(llll)", &out, &half, &q, &s, &g->n[0], &g->n[1], &g->n[2],
                          &g->d, &g->os[0], &g->os[1], &g->os[2], &g->qs[0], &g->qs[1], &g->qs[2], &g->ss[0],
                          &g->ss[1], &g->ss[2], &g->sd))
        return NULL;
    if (!level) {
        PyErr_SetString(PyExc_RuntimeError, "no native kernel on this CPU");
        return NULL;
    }
    if (g->d % 16 || (g->sd != 0 && g->sd != 1) || g->n[0] < 0 || g->n[1] < 0 || g->n[2] < 0 || g->d < 0) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
#ifdef KV_X86
    Py_BEGIN_ALLOW_THREADS
    if (level == 2)
        int8_avx512((char *)(uintptr_t)out, half, (const int8_t *)(uintptr_t)q, (const uint16_t *)(uintptr_t)s, g);
    else
        int8_avx2((char *)(uintptr_t)out, half, (const int8_t *)(uintptr_t)q, (const uint16_t *)(uintptr_t)s, g);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *int8_rows(PyObject *self, PyObject *args) {
    unsigned long long out, q, s;
    long out_l, out_a, n_l, q_l, s_l;
    Shape shape, *g = &shape;
    (void)self;
    if (!PyArg_ParseTuple(args, "K(ll)KK(lllll)(llll)(lllll)", &out, &out_l, &out_a, &q, &s, &n_l, &g->n[0],
                          &g->n[1], &g->n[2], &g->d, &q_l, &g->qs[0], &g->qs[1], &g->qs[2], &s_l, &g->ss[0],
                          &g->ss[1], &g->ss[2], &g->sd))
        return NULL;
    if (!level) {
        PyErr_SetString(PyExc_RuntimeError, "no native kernel on this CPU");
        return NULL;
    }
    if (g->d <= 0 || g->d % 16 || (g->sd != 0 && g->sd != 1) || n_l < 0 || g->n[0] < 0 || g->n[1] <= 0 ||
        g->n[2] < 0 || g->n[1] * g->d > STAGE_ELEMENTS) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
#ifdef KV_X86
    Py_BEGIN_ALLOW_THREADS
    for (long l = 0; l < n_l; l++)
        int8_rows_streamed((uint16_t *)(uintptr_t)out + l * out_l, out_a, (const int8_t *)(uintptr_t)q + l * q_l,
                           (const uint16_t *)(uintptr_t)s + l * s_l, g);
    _mm_sfence(); /* the streamed lines reach memory before whoever reads them next (llama.cpp, another thread) */
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *int4(PyObject *self, PyObject *args) {
    unsigned long long out, codes, s, z;
    int half;
    Shape4 shape, *g = &shape;
    (void)self;
    if (!PyArg_ParseTuple(args, "KpKKK(lllll)(llll)(llll)(lllll)", &out, &half, &codes, &s, &z, &g->n[0],
                          &g->n[1], &g->n[2], &g->n[3], &g->f, &g->os[0], &g->os[1], &g->os[2], &g->os[3],
                          &g->cs[0], &g->cs[1], &g->cs[2], &g->cs[3], &g->ss[0], &g->ss[1], &g->ss[2], &g->ss[3],
                          &g->sf))
        return NULL;
    if (!level) {
        PyErr_SetString(PyExc_RuntimeError, "no native kernel on this CPU");
        return NULL;
    }
    int odd = 0;
    for (int i = 0; i < 4; i++)
        odd |= g->n[i] < 0 || g->cs[i] % 2;
    if (odd || g->f % 16 || g->f < 0 || (g->sf != 0 && g->sf != 1)) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
#ifdef KV_X86
    Py_BEGIN_ALLOW_THREADS
    if (level == 2)
        int4_avx512((char *)(uintptr_t)out, half, (const uint8_t *)(uintptr_t)codes, (const uint16_t *)(uintptr_t)s,
                    (const uint16_t *)(uintptr_t)z, g);
    else
        int4_avx2((char *)(uintptr_t)out, half, (const uint8_t *)(uintptr_t)codes, (const uint16_t *)(uintptr_t)s,
                  (const uint16_t *)(uintptr_t)z, g);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

/* attend(out, in, codes, scales, offsets, bits, values, (A, H, T, D, M, group), code_strides, scale_strides,
 * row_strides, score_strides): scores (values false: out the scores, in the queries) or weighted values (out the
 * output, accumulated; in the weights) over int8 (bits 8; offsets unused) or int4 (bits 4) codes. */
static PyObject *attend(PyObject *self, PyObject *args) {
    unsigned long long out, in, codes, s, z;
    int bits, values;
    Attend shape, *g = &shape;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKip(llllll)(lll)(lll)(ll)(lll)", &out, &in, &codes, &s, &z, &bits, &values,
                          &g->n[0], &g->n[1], &g->n[2], &g->d, &g->m, &g->group, &g->cs[0], &g->cs[1], &g->cs[2],
                          &g->ss[0], &g->ss[1], &g->ss[2], &g->qs[0], &g->qs[1], &g->ps[0], &g->ps[1], &g->ps[2]))
        return NULL;
    if (!level) {
        PyErr_SetString(PyExc_RuntimeError, "no native kernel on this CPU");
        return NULL;
    }
    int odd = bits == 4 && (g->cs[0] % 2 || g->cs[1] % 2 || g->cs[2] % 2);
    int kind = bits == 8 ? 0 : bits == 4 ? 1 : bits == 16 ? 2 : bits == 32 ? 3 : -1;
    if (kind < 0 || odd || g->d % 16 || g->d <= 0 || g->d > 256 || g->m < 0 || g->n[0] < 0 ||
        g->n[1] < 0 || g->n[2] < 0 || g->group <= 0 || (values && g->group % 16)) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
#ifdef KV_X86
    Pass *pass = passes[level - 1][values][kind];
    Py_BEGIN_ALLOW_THREADS
    pass((float *)(uintptr_t)out, (const float *)(uintptr_t)in, (const void *)(uintptr_t)codes,
         (const uint16_t *)(uintptr_t)s, (const uint16_t *)(uintptr_t)z, g);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

#ifdef KV_X86
/* dst[c][r] = src[r][c] for an 8 x 8 block of 2-byte elements, in SSE2 registers (every x86-64 CPU has it). */
static inline void block8(uint16_t *o, long dc, const uint16_t *i, long sr) {
    __m128i a0 = _mm_loadu_si128((const __m128i *)(i + 0 * sr)), a1 = _mm_loadu_si128((const __m128i *)(i + 1 * sr));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(i + 2 * sr)), a3 = _mm_loadu_si128((const __m128i *)(i + 3 * sr));
    __m128i a4 = _mm_loadu_si128((const __m128i *)(i + 4 * sr)), a5 = _mm_loadu_si128((const __m128i *)(i + 5 * sr));
    __m128i a6 = _mm_loadu_si128((const __m128i *)(i + 6 * sr)), a7 = _mm_loadu_si128((const __m128i *)(i + 7 * sr));
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);
    __m128i b4 = _mm_unpacklo_epi16(a4, a5), b5 = _mm_unpackhi_epi16(a4, a5);
    __m128i b6 = _mm_unpacklo_epi16(a6, a7), b7 = _mm_unpackhi_epi16(a6, a7);
    __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);
    __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
    __m128i c4 = _mm_unpacklo_epi32(b4, b6), c5 = _mm_unpackhi_epi32(b4, b6);
    __m128i c6 = _mm_unpacklo_epi32(b5, b7), c7 = _mm_unpackhi_epi32(b5, b7);
    _mm_storeu_si128((__m128i *)(o + 0 * dc), _mm_unpacklo_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(o + 1 * dc), _mm_unpackhi_epi64(c0, c4));
    _mm_storeu_si128((__m128i *)(o + 2 * dc), _mm_unpacklo_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(o + 3 * dc), _mm_unpackhi_epi64(c1, c5));
    _mm_storeu_si128((__m128i *)(o + 4 * dc), _mm_unpacklo_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(o + 5 * dc), _mm_unpackhi_epi64(c2, c6));
    _mm_storeu_si128((__m128i *)(o + 6 * dc), _mm_unpacklo_epi64(c3, c7));
    _mm_storeu_si128((__m128i *)(o + 7 * dc), _mm_unpackhi_epi64(c3, c7));
}
#endif

/* One matrix: dst[c][r] = src[r][c], r < R, c < C; 8 columns at a time over every row, so 8 rows of dst are written
 * one after another (rows of dst a power of two apart, written a few elements each in turn, evict one another from
 * L1 and the write buffers: 2x slower), from rows of src read again from L2 for each 8 columns. */
static void matrix16(uint16_t *out, long dc, const uint16_t *in, long sr, long r_n, long c_n) {
    long rb = 0, cb = 0;
#ifdef KV_X86
    rb = r_n / 8 * 8;
    cb = c_n / 8 * 8;
    for (long c = 0; c < cb; c += 8)
        for (long r = 0; r < rb; r += 8)
            block8(out + c * dc + r, dc, in + r * sr + c, sr);
#endif
    for (long c = 0; c < c_n; c++)  /* what no block covers: rows from rb on, and columns from cb on */
        for (long r = c < cb ? rb : 0; r < r_n; r++)
            out[c * dc + r] = in[r * sr + c];
}

/* transpose16(dst, src, (K, R, C), dst_strides (k, c), src_strides (k, r)): dst[k][c][r] = src[k][r][c] for 2-byte
 * elements (fp16 bits, moved as they are), rows contiguous in both; strides in elements. A llama.cpp state without
 * flash attention stores V transposed: each layer's [tokens, channels] is written as [channels, tokens]. In 8 x 8
 * register blocks (SSE2), the rest element by element: the same bits on every CPU; numpy's strided copy of a
 * 2048-token SmolLM2 V takes 2-3x as long. */
static PyObject *transpose16(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    long k_n, r_n, c_n, dk, dc, sk, sr;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK(lll)(ll)(ll)", &dst, &src, &k_n, &r_n, &c_n, &dk, &dc, &sk, &sr))
        return NULL;
    if (k_n < 0 || r_n < 0 || c_n < 0 || dc < r_n || sr < c_n) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
    uint16_t *out = (uint16_t *)(uintptr_t)dst;
    const uint16_t *in = (const uint16_t *)(uintptr_t)src;
    Py_BEGIN_ALLOW_THREADS
    for (long k = 0; k < k_n; k++)
        matrix16(out + k * dk, dc, in + k * sk, sr, r_n, c_n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* hadamard(data, (rows, size), scale): each row of `size` fp32 values (a power of two, contiguous, rows side by side)
 * replaced in place by its fast Walsh-Hadamard transform times `scale`: rounds h = 1, 2, 4, ... of (a, b) -> (a + b,
 * a - b) over the values h apart, then one multiply. Sums, differences and a product, each rounded once, in the order
 * cachestore/codec/rotation.py computes them for numpy and torch on other devices: the same bits (plain C, no
 * reassociation; nothing to contract into a fused multiply-add). */
static PyObject *hadamard(PyObject *self, PyObject *args) {
    unsigned long long addr;
    long rows, size;
    float scale;
    (void)self;
    if (!PyArg_ParseTuple(args, "K(ll)f", &addr, &rows, &size, &scale))
        return NULL;
    if (rows < 0 || size < 1 || (size & (size - 1)) || size > 4096) {
        PyErr_SetString(PyExc_ValueError, "unsupported shape");
        return NULL;
    }
    float *data = (float *)(uintptr_t)addr;
    Py_BEGIN_ALLOW_THREADS
    for (long r = 0; r < rows; r++) {
        float *x = data + r * size;
        for (long h = 1; h < size; h *= 2)
            for (long i = 0; i < size; i += 2 * h)
                for (long j = i; j < i + h; j++) {
                    float a = x[j], b = x[j + h];
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
        for (long j = 0; j < size; j++)
            x[j] *= scale;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *use(PyObject *self, PyObject *args) {
    int wanted;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &wanted))
        return NULL;
    level = wanted < 0 ? 0 : (wanted < detected ? wanted : detected);
    return PyLong_FromLong(level);
}

static PyMethodDef methods[] = {
    {"use", use, METH_VARARGS, "use(level) -> the level in use: at most the CPU's (tests run the AVX2 path with it)"},
    {"int8", int8, METH_VARARGS,
     "int8(out, half, codes, scales, (A, B, T, D), out_strides[3], code_strides[3], scale_strides[4]): "
     "out = codes * scales (fp32 out, or fp16 when half); addresses and strides in elements, as kernels.py checks "
     "them"},
    {"int8_rows", int8_rows, METH_VARARGS,
     "int8_rows(out, (out_l, out_a), codes, scales, (L, A, B, T, D), code_strides[4], scale_strides[5]): fp16 "
     "out = codes * scales, where out + l * out_l + a * out_a holds token t's B x D elements at t * B * D; streamed "
     "past the cache"},
    {"int4", int4, METH_VARARGS,
     "int4(out, half, packed, scales, offsets, (A, B, C, E, F), out_strides[4], code_strides[4], "
     "scale_strides[5]): out = codes * scales + offsets; code strides in codes (two a byte), the rest in elements"},
    {"attend", attend, METH_VARARGS,
     "attend(out, in, codes, scales, offsets, bits, values, (A, H, T, D, M, group), code_strides[3], "
     "scale_strides[3], row_strides[2], score_strides[3]): scores[h, m, a, t] = queries[h, m] . k[a, h, t], or "
     "out[h, m] += sum over a, t of weights[h, m, a, t] * v[a, h, t], over int8 or int4 codes (kernels.py)"},
    {"hadamard", hadamard, METH_VARARGS,
     "hadamard(data, (rows, size), scale): each contiguous fp32 row of `size` (a power of two) in place = its fast "
     "Walsh-Hadamard transform times scale (rotation.py)"},
    {"transpose16", transpose16, METH_VARARGS,
     "transpose16(dst, src, (K, R, C), dst_strides[2], src_strides[2]): dst[k][c][r] = src[k][r][c], 2-byte "
     "elements, rows contiguous; strides in elements (kernels.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        detected = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
        detected = 1;
#endif
    level = detected;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "level", detected) < 0 ||
                      PyModule_AddIntConstant(m, "stage_elements", STAGE_ELEMENTS) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
