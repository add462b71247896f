/* Native dequantization for the hot path of a hit: cachestore/kernels.py is its only caller and checks every
 * tensor it hands over (dtypes, shapes, strides; all from live torch tensors, so every address is in bounds).
 *
 * int8 codes times their fp16 scales, and int4 codes (two a byte, low nibble first) times their fp16 scales plus
 * their fp16 offsets, into fp32 (the transformers context) or fp16 (llama.cpp's sequence state), in one pass: torch
 * unpacks, converts, then scales and offsets in passes of their own over the output, and reaches fp16 only through
 * an fp32 temporary. The product is exact in fp32 (8- or 4-bit codes, 11-bit scales), the sum rounded once, and
 * fp16 rounded once more, to nearest even: the very values torch computes. x86-64 with AVX-512F, or AVX2 and F16C,
 * chosen once at import; elsewhere `level` is 0 and the caller uses torch.
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
 * its packed codes, and `at`, its first scale and offset. */
#define INT4_ROWS(g, codes, ...)                                                                       \
    for (long a = 0; a < (g)->n[0]; a++)                                                               \
    for (long b = 0; b < (g)->n[1]; b++)                                                               \
    for (long c = 0; c < (g)->n[2]; c++)                                                               \
    for (long e = 0; e < (g)->n[3]; e++) {                                                             \
        long o = a * (g)->os[0] + b * (g)->os[1] + c * (g)->os[2] + e * (g)->os[3];                    \
        const uint8_t *cr = (codes) + (a * (g)->cs[0] + b * (g)->cs[1] + c * (g)->cs[2] + e * (g)->cs[3]) / 2;\
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
                                                            const uint16_t *s, const uint16_t *z,
                                                            const Shape4 *g) {
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
            store16(out, half, o + d,
                    _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(pairs)), scale), zero));
        })
}

__attribute__((target("avx2,f16c"))) static void int4_avx2(char *out, int half, const uint8_t *codes,
                                                           const uint16_t *s, const uint16_t *z,
                                                           const Shape4 *g) {
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
            store8(out, half, o + d,
                   _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(pairs)), scale), zero));
        })
}
#endif

static int detected = 0; /* 2: AVX-512F, 1: AVX2 + F16C, 0: none (the caller uses torch) */
static int level = 0;    /* the one in use: `detected`, or less (`use`, for tests) */

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

static PyObject *int4(PyObject *self, PyObject *args) {
    unsigned long long out, codes, s, z;
    int half;
    Shape4 shape, *g = &shape;
    (void)self;
    if (!PyArg_ParseTuple(args, "KpKKK(lllll)(llll)(llll)(lllll)", &out, &half, &codes, &s, &z, &g->n[0], &g->n[1],
                          &g->n[2], &g->n[3], &g->f, &g->os[0], &g->os[1], &g->os[2], &g->os[3], &g->cs[0],
                          &g->cs[1], &g->cs[2], &g->cs[3], &g->ss[0], &g->ss[1], &g->ss[2], &g->ss[3], &g->sf))
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
    {"int4", int4, METH_VARARGS,
     "int4(out, half, packed, scales, offsets, (A, B, C, E, F), out_strides[4], code_strides[4], scale_strides[5]): "
     "out = codes * scales + offsets; code strides in codes (two a byte), the rest in elements"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
#ifdef KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        detected = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
        detected = 1;
#endif
    level = detected;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "level", detected) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
