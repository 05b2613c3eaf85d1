/* y = x @ W^T on the CPU with W kept packed (kernels/qweight.py's QuantWeight layout, MXFP4's E2M1 codebook too),
 * in fp32, with AVX2.
 *
 * Each weight row is expanded into fp32 values exactly as the torch reference does it (one rounding for the scale
 * product, one for the offset add: never fused into an FMA), then dotted with the activations, so the result is
 * fp32 math on the dequantized weights; only the order of the sums differs from a dense matmul.
 * K and the group size must be multiples of 16 (the last group may be shorter). The decode step's small ops
 * (RMSNorm, RoPE, the gated activations, paged attention) follow at the end. Built at first use by
 * kernels/cpu_native.py and called through ctypes.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float param(const void *p, int f16, long i) {
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The pragma keeps s * q + o two roundings, as in torch; the dot products use explicit FMA instructions, which
 * it does not touch. Everything that expands weights lives between push_options and pop_options. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* Values c .. c + 15 of a row as bytes, in order. Symmetric values come re-centred (q - 2^(bits-1) fits an
 * int8 exactly), which saves a float subtraction later. */
static inline __m128i bytes16(const uint8_t *p, long c, int bits, int affine) {
    __m128i q;
    if (bits == 4) {  /* byte j holds value 2j in its low nibble and 2j + 1 in its high one */
        const __m128i nibble = _mm_set1_epi8(15);
        __m128i b = _mm_loadl_epi64((const __m128i *)(p + c / 2));
        q = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
    } else {
        q = _mm_loadu_si128((const __m128i *)(p + c));
    }
    return affine ? q : _mm_sub_epi8(q, _mm_set1_epi8((char)(1 << (bits - 1))));
}

/* MXFP4's E2M1 value of each 4-bit code (kernels/qweight.py's CODEBOOKS) */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

#ifdef __AVX512F__
typedef __m512 vec16;  /* 16 fp32 values: one AVX-512 register, or two AVX2 ones */
static inline vec16 expand16(__m128i q, float s, float o, int affine) {
    if (affine) return _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))),
                                     _mm512_set1_ps(o));
    return _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
}
static inline vec16 fma16(vec16 w, const float *x, vec16 acc) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
static inline void store16(float *w, vec16 v) { _mm512_storeu_ps(w, v); }
static inline vec16 zero16(void) { return _mm512_setzero_ps(); }
static inline float sum16(vec16 v) { return _mm512_reduce_add_ps(v); }
#else
typedef struct { __m256 lo, hi; } vec16;
static inline vec16 expand16(__m128i q, float s, float o, int affine) {
    __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
    __m128i q_hi = _mm_srli_si128(q, 8);
    if (affine)
        return (vec16){_mm256_add_ps(_mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), vo),
                       _mm256_add_ps(_mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q_hi))), vo)};
    return (vec16){_mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))),
                   _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q_hi)))};
}
static inline vec16 fma16(vec16 w, const float *x, vec16 acc) {
    return (vec16){_mm256_fmadd_ps(w.lo, _mm256_loadu_ps(x), acc.lo),
                   _mm256_fmadd_ps(w.hi, _mm256_loadu_ps(x + 8), acc.hi)};
}
static inline void store16(float *w, vec16 v) {
    _mm256_storeu_ps(w, v.lo);
    _mm256_storeu_ps(w + 8, v.hi);
}
static inline vec16 zero16(void) { return (vec16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
/* E2M1 codes q (8 as epi32) -> table8[q & 7] (s * the magnitudes), with q's sign bit (8) moved to the float's */
static inline __m256 e2m1_8(__m256i q, __m256 table8) {
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(table8, q), _mm256_castsi256_ps(sign));
}
#endif

static inline float hsum(__m256 acc) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#ifndef __AVX512F__
static inline float sum16(vec16 v) { return hsum(_mm256_add_ps(v.lo, v.hi)); }
#endif

/* Row n of the weight, expanded: into w[K] when `w` is given, else dotted with x[K] on the fly (one token). */
static inline __attribute__((always_inline)) float expand_row_as(const uint8_t *packed, const void *scales,
                                                                 const void *offsets, int f16, int bits, int gs,
                                                                 long K, long n, float *w, const float *x,
                                                                 const int affine, const int e2m1) {
    const long groups = (K + gs - 1) / gs;  /* the last one short when gs does not divide K */
    const uint8_t *p = packed + n * (K * bits / 8);
    vec16 acc = zero16(), acc1 = zero16();  /* two sums: consecutive FMAs do not wait on each other */
    for (long g = 0; g < groups; g++) {
        const float s = param(scales, f16, n * groups + g);
        const float o = affine ? param(offsets, f16, n * groups + g) : 0.0f;
#ifdef __AVX512F__
        /* 4-bit: the group's 16 possible weights, computed as expand16 would, then looked up: two instructions
         * for 16 values instead of four */
        const __m128i values = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const vec16 table = bits != 4 ? zero16()
                            : e2m1    ? _mm512_mul_ps(_mm512_set1_ps(s), _mm512_loadu_ps(E2M1))
                            : affine  ? expand16(values, s, o, 1)
                                      : expand16(_mm_sub_epi8(values, _mm_set1_epi8(8)), s, o, 0);
#else
        const __m256 table8 = e2m1 ? _mm256_mul_ps(_mm256_set1_ps(s), _mm256_loadu_ps(E2M1)) : _mm256_setzero_ps();
#endif
        const long end = (g + 1) * gs < K ? (g + 1) * gs : K;
        for (long c = g * gs; c < end; c += 16) {
#ifdef __AVX512F__
            vec16 v = bits == 4 ? _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes16(p, c, 4, 1)), table)
                                : expand16(bytes16(p, c, bits, affine), s, o, affine);
#else
            __m128i q = bytes16(p, c, bits, affine | e2m1);
            vec16 v = e2m1 ? (vec16){e2m1_8(_mm256_cvtepu8_epi32(q), table8),
                                     e2m1_8(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), table8)}
                           : expand16(q, s, o, affine);
#endif
            if (w) {
                store16(w + c, v);
            } else {
                vec16 next = fma16(v, x + c, acc);
                acc = acc1;
                acc1 = next;
            }
        }
    }
    return sum16(acc) + sum16(acc1);
}

/* expand_row_as compiled once for each format, so its inner loop holds no test of the format. */
static float expand_row(const uint8_t *packed, const void *scales, const void *offsets, int f16, int bits, int e2m1,
                        int gs, long K, long n, float *w, const float *x) {
#define ROW(BITS, AFFINE, E2M1) expand_row_as(packed, scales, offsets, f16, BITS, gs, K, n, w, x, AFFINE, E2M1)
    if (e2m1) return ROW(4, 0, 1);
    if (bits == 4) return offsets ? ROW(4, 1, 0) : ROW(4, 0, 0);
    return offsets ? ROW(8, 1, 0) : ROW(8, 0, 0);
#undef ROW
}
#pragma GCC pop_options

static inline float dot(const float *a, const float *b, long K) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (long k = 0; k < K; k += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* ---- a thread pool that never waits for a late thread ----
 * Work is split into chunks that threads claim one at a time from a shared counter; the calling thread claims too
 * and waits only for chunks already claimed, so a helper that the OS has not scheduled (shared cores) costs
 * nothing: the caller does its share. Calls come one at a time (the engine's loop thread; `lock` for others).
 * A job's fields live in slot gen & 1, and the counter holds (gen << 32 | next chunk): a helper can only claim a
 * chunk of the job whose fields it read, since a claim is a compare-and-swap on that generation. */

typedef void (*chunk_fn)(const void *args, long chunk);

struct job {
    chunk_fn fn;
    const void *args;
    long chunks;
    atomic_long done;
};

static struct job jobs[2];
static atomic_ullong state;  /* gen << 32 | next chunk to claim */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER, sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int helpers;  /* threads started */

/* Run chunks of the current job until none is left; returns whether it ran any. */
static int work(void) {
    for (int ran = 0;;) {
        unsigned long long s = atomic_load(&state);
        struct job *j = &jobs[(s >> 32) & 1];
        long next = (long)(s & 0xffffffffu);
        chunk_fn fn = j->fn;
        const void *args = j->args;
        if (next >= j->chunks) return ran;
        if (!atomic_compare_exchange_weak(&state, &s, s + 1)) continue;
        fn(args, next);
        atomic_fetch_add(&j->done, 1);
        ran = 1;
    }
}

static void *helper(void *unused) {
    (void)unused;
    for (;;) {
        /* spin a little first: the next matmul of the step comes within microseconds */
        for (int i = 0; i < 20000; i++) {
            if (work()) i = 0;
            _mm_pause();
        }
        pthread_mutex_lock(&sleep_lock);
        unsigned long long s = atomic_load(&state);
        struct job *j = &jobs[(s >> 32) & 1];
        if ((long)(s & 0xffffffffu) >= j->chunks) pthread_cond_wait(&wake, &sleep_lock);
        pthread_mutex_unlock(&sleep_lock);
    }
    return 0;
}

static void parallel(chunk_fn fn, const void *args, long chunks, int threads) {
    if (threads <= 1 || chunks == 1) {
        for (long c = 0; c < chunks; c++) fn(args, c);
        return;
    }
    pthread_mutex_lock(&lock);
    for (; helpers < threads - 1; helpers++) {
        pthread_t t;
        if (pthread_create(&t, 0, helper, 0)) break;
        pthread_detach(t);
    }
    unsigned long long gen = (atomic_load(&state) >> 32) + 1;
    struct job *j = &jobs[gen & 1];
    j->fn = fn;
    j->args = args;
    j->chunks = chunks;
    atomic_store(&j->done, 0);
    pthread_mutex_lock(&sleep_lock);
    atomic_store(&state, gen << 32);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    work();
    while (atomic_load(&j->done) < chunks) _mm_pause();  /* chunks a helper is still running */
    pthread_mutex_unlock(&lock);
}

/* ---- the entry points ---- */

enum { ROWS_PER_CHUNK = 32 };

struct matmul_args {
    const float *x;
    long T, K, N;
    const uint8_t *packed;
    const void *scales, *offsets;
    int f16, bits, e2m1, gs;
    float *y;
};

/* One token: rows expand straight into the dot product. More: each row is expanded into a buffer that stays in
 * L1 and dotted with every token. */
static void matmul_chunk(const void *args, long chunk) {
    const struct matmul_args *a = args;
    long end = (chunk + 1) * ROWS_PER_CHUNK < a->N ? (chunk + 1) * ROWS_PER_CHUNK : a->N;
    float *w = a->T > 1 ? malloc(a->K * sizeof(float)) : 0;
    for (long n = chunk * ROWS_PER_CHUNK; n < end; n++) {
        if (a->T == 1) {
            a->y[n] = expand_row(a->packed, a->scales, a->offsets, a->f16, a->bits, a->e2m1, a->gs, a->K, n, 0, a->x);
            continue;
        }
        expand_row(a->packed, a->scales, a->offsets, a->f16, a->bits, a->e2m1, a->gs, a->K, n, w, 0);
        for (long t = 0; t < a->T; t++) a->y[t * a->N + n] = dot(a->x + t * a->K, w, a->K);
    }
    free(w);
}

/* x [T, K], y [T, N] = x @ W^T; e2m1: W's 4-bit codes are MXFP4's (w = scale * E2M1[q]). */
void qmatmul(const float *x, long T, long K, const uint8_t *packed, const void *scales, const void *offsets,
             int f16, int bits, int e2m1, int gs, long N, float *y, int threads) {
    struct matmul_args a = {x, T, K, N, packed, scales, offsets, f16, bits, e2m1, gs, y};
    parallel(matmul_chunk, &a, (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK, threads);
}

static void dequantize_chunk(const void *args, long chunk) {
    const struct matmul_args *a = args;
    long end = (chunk + 1) * ROWS_PER_CHUNK < a->N ? (chunk + 1) * ROWS_PER_CHUNK : a->N;
    for (long n = chunk * ROWS_PER_CHUNK; n < end; n++)
        expand_row(a->packed, a->scales, a->offsets, a->f16, a->bits, a->e2m1, a->gs, a->K, n, a->y + n * a->K, 0);
}

/* y [N, K]: the whole weight in fp32, for long prefill chunks (a dense matmul then beats T dot products). */
void dequantize(const uint8_t *packed, const void *scales, const void *offsets, int f16, int bits, int e2m1, int gs,
                long K, long N, float *y, int threads) {
    struct matmul_args a = {0, 0, K, N, packed, scales, offsets, f16, bits, e2m1, gs, y};
    parallel(dequantize_chunk, &a, (N + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK, threads);
}

/* ---- the decode step's small ops, one call each instead of a dozen torch ops (fp32, one thread) ---- */

/* x [T, H] (+ residual: their sum goes to `sum`) -> out = weight * (v / rms(v)), as kernels/norm.py. */
void rms_norm(const float *x, const float *residual, const float *weight, float eps, long T, long H, float *out,
              float *sum) {
    for (long t = 0; t < T; t++) {
        float *ot = out + t * H, squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (long i = 0; i < H; i++) {
            float v = residual ? x[t * H + i] + residual[t * H + i] : x[t * H + i];
            if (residual) sum[t * H + i] = v;
            ot[i] = v;
            squares += v * v;
        }
        float inv = 1.0f / sqrtf(squares / (float)H + eps);
        for (long i = 0; i < H; i++) ot[i] = weight[i] * (ot[i] * inv);
    }
}

/* q [T, Hq, D], k [T, Hk, D] rotated into q_out, k_out (half-split convention), as kernels/rope.py. Token t's
   inverse frequencies start at inv_freq + t * inv_stride (0: one row for all tokens). */
void rope(const float *q, const float *k, float *q_out, float *k_out, const int64_t *positions, const float *inv_freq,
          long inv_stride, long T, long Hq, long Hk, long D) {
    long half = D / 2;
    float c[half], s[half];
    for (long t = 0; t < T; t++) {
        for (long i = 0; i < half; i++) {
            float f = (float)positions[t] * inv_freq[t * inv_stride + i];
            c[i] = cosf(f);
            s[i] = sinf(f);
        }
        for (long h = 0; h < Hq + Hk; h++) {
            long at = h < Hq ? (t * Hq + h) * D : (t * Hk + h - Hq) * D;
            const float *x = (h < Hq ? q : k) + at;
            float *y = (h < Hq ? q_out : k_out) + at;
            for (long i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                y[i] = x1 * c[i] - x2 * s[i];
                y[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* out [T, I] = gelu(gate) * up, GELU's tanh form (Gemma's GeGLU), as kernels/activation.py: g * (1 + tanh(z)) / 2
   computed as g / (1 + exp(-2z)), z = sqrt(2 / pi) * (g + 0.044715 g^3). */
void gelu_tanh_and_mul(const float *gate_up, long T, long I, float *out) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < I; i++) {
            float g = gate_up[t * 2 * I + i];
            float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            out[t * I + i] = g / (1.0f + expf(-2.0f * z)) * gate_up[t * 2 * I + I + i];
        }
}

/* out [T, I] = silu(gate) * up for gate_up [T, 2I], as kernels/activation.py. */
void silu_and_mul(const float *gate_up, long T, long I, float *out) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < I; i++) {
            float g = gate_up[t * 2 * I + i];
            out[t * I + i] = g / (1.0f + expf(-g)) * gate_up[t * 2 * I + I + i];
        }
}

/* out [T, I] = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7): gpt-oss's clamped SwiGLU, as
   kernels/activation.py. */
void swiglu_oai_and_mul(const float *gate_up, long T, long I, float *out) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < I; i++) {
            float g = fminf(gate_up[t * 2 * I + i], 7.0f), u = fmaxf(fminf(gate_up[t * 2 * I + I + i], 7.0f), -7.0f);
            out[t * I + i] = g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
        }
}

/* Causal attention over the paged cache, as kernels/attention.py: q [T, Hq, D] -> out [T, Hq, D]; caches
 * [blocks, block_size, Hk, D]; sequence b owns queries qsl[b] .. qsl[b + 1] - 1, the last of its ctx[b] tokens.
 * window > 0: each query sees its last `window` keys only (blocks before them may be freed: never read).
 * sinks [Hq] (or NULL): each head's sink logit joins the softmax as a key with no value. */
void paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                     long max_blocks, const int64_t *context_lens, const int64_t *query_start_loc, long B, long Hq,
                     long Hk, long D, long block_size, float scale, long window, const float *sinks, float *out) {
    long group = Hq / Hk, longest = 0;
    for (long b = 0; b < B; b++) longest = context_lens[b] > longest ? context_lens[b] : longest;
    float *p = malloc((longest > 0 ? longest : 1) * sizeof(float));
    for (long b = 0; b < B; b++) {
        long s = query_start_loc[b], n = query_start_loc[b + 1] - s, ctx = context_lens[b];
        const int32_t *table = block_tables + b * max_blocks;
        for (long i = 0; i < n; i++) {
            long seen = ctx - n + i + 1;  /* keys first .. ctx - n + i */
            long first = window > 0 && seen > window ? seen - window : 0;
            for (long h = 0; h < Hq; h++) {
                const float *qh = q + ((s + i) * Hq + h) * D;
                long kv = h / group;
                float top = -INFINITY, total = 0.0f;
                for (long j = first; j < seen; j++) {
                    const float *kj = k_cache + ((table[j / block_size] * block_size + j % block_size) * Hk + kv) * D;
                    float d = 0.0f;
#pragma omp simd reduction(+ : d)
                    for (long e = 0; e < D; e++) d += qh[e] * kj[e];
                    p[j] = d * scale;
                    top = p[j] > top ? p[j] : top;
                }
                if (sinks) {
                    top = sinks[h] > top ? sinks[h] : top;
                    total = expf(sinks[h] - top);
                }
                for (long j = first; j < seen; j++) total += (p[j] = expf(p[j] - top));
                float *oh = out + ((s + i) * Hq + h) * D;
                for (long e = 0; e < D; e++) oh[e] = 0.0f;
                for (long j = first; j < seen; j++) {
                    const float *vj = v_cache + ((table[j / block_size] * block_size + j % block_size) * Hk + kv) * D;
                    float w = p[j] / total;
#pragma omp simd
                    for (long e = 0; e < D; e++) oh[e] += w * vj[e];
                }
            }
        }
    }
    free(p);
}

/* k, v [T, Hk * D] stored at flat cache slots (block * block_size + offset); slot -1 means skip. */
void write_kv(const float *k, const float *v, float *k_cache, float *v_cache, const int64_t *slots, long T, long row) {
    for (long t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, k + t * row, row * sizeof(float));
        memcpy(v_cache + slots[t] * row, v + t * row, row * sizeof(float));
    }
}
