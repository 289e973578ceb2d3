/* tierzero CPU Adam: one pass over a flat fp32 shard.
 *
 * Built at first use by offload/adam_build.py with the system C compiler
 * (no torch headers, so it compiles in about a second) and called through
 * ctypes on tensor data pointers; ctypes releases the GIL, so Python threads
 * run disjoint [lo, hi) ranges of one shard in parallel.
 *
 * [Note: Adam operation order]
 * Each element goes through exactly the operations torch.optim.Adam's
 * single-tensor path performs, in the same order and the same fp32 rounding,
 * so results match PyTorch within about an ulp per step (tests state the
 * tolerance). The file is compiled with -ffp-contract=off: the compiler may
 * not fuse a*b+c on its own; where ATen's vectorised kernels use a fused
 * multiply-add (lerp, add with alpha, addcmul) we call fmaf explicitly.
 * Remaining differences: ATen's vectorised sqrt is not correctly rounded
 * (one ulp off on ~0.6% of inputs; ours is IEEE), its scalar tail does not
 * fuse what its vector body fuses, and subnormals (see [Note: subnormals]).
 *
 *   g  = grad * grad_scale                       (only if grad_scale != 1)
 *   AdamW: p = p * (1 - lr*wd)                   (Tensor.mul_)
 *   Adam:  g = fma(p, wd, g)                     (grad.add(p, alpha=wd))
 *   m  = fma(w', g - m, small ? m : g)           (Tensor.lerp_, w = 1-beta1,
 *                                                  w' = small ? w : w-1)
 *   v  = v * beta2;  v = fma((1-beta2) * g, g, v)  (mul_, addcmul_)
 *   d  = sqrt(v) / sqrt(bc2) + eps               (sqrt, div, add_)
 *   p  = p + ((-lr/bc1) * m) / d                 (addcdiv_)
 *   out16 = round_to_nearest_even(p)             (Tensor.to(bf16/fp16))
 *
 * Memory traffic per element: read p, m, v, g; write p, m, v and out16.
 * Nothing is read or written twice.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* [Note: subnormals]
 * Moments of parameters that get zero gradients for a while (embedding rows of
 * rare tokens) decay geometrically and become subnormal (m after ~800 steps at
 * beta1 = 0.9); on x86 every operation on a subnormal takes a microcode assist:
 * measured 17x slower steps (torch's fused AdamW is equally slow). The kernel
 * therefore runs with flush-to-zero and denormals-are-zero set in this thread's
 * MXCSR and restores it on return. Only values below 1.2e-38 are affected, and
 * with eps >= 1e-38 their effect on the parameter update is below 1e-30 -- far
 * inside the tolerance against torch. The fp16 -> fp32 conversion (VCVTPH2PS)
 * and the bf16 paths are integer/convert ops that keep fp16 subnormals intact
 * (tested). */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
static inline unsigned tz_enter(void) {
    unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) | DAZ (bit 6) */
    return old;
}
static inline void tz_leave(unsigned old) { _mm_setcsr(old); }
#else
static inline unsigned tz_enter(void) { return 0; }
static inline void tz_leave(unsigned old) { (void)old; }
#endif

typedef struct {
    float grad_scale;  /* 1.0f: no scaling */
    float decay;       /* AdamW: 1 - lr*wd */
    float wd;          /* Adam (L2): weight decay added to the gradient */
    float w;           /* lerp weight 1 - beta1 */
    float w_coeff;     /* w if |w| < 0.5 else w - 1 */
    int   w_small;     /* |w| < 0.5 */
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;    /* sqrt(1 - beta2^step) */
    float eps;
    float neg_step_size; /* -lr / (1 - beta1^step) */
    int   decoupled;   /* 1: AdamW, 0: Adam with L2 */
    int   apply_decay; /* weight_decay != 0 */
    int   apply_scale; /* grad_scale != 1 */
} tz_adam_hp;

/* Version of the argument layout above; adam_build.py checks it. */
int tz_adam_abi_version(void) { return 5; }

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round to nearest even, as c10::BFloat16 does; NaN becomes the quiet NaN 0x7fc0. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(is_nan ? 0x7fc0u : rounded);
}

static inline float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

static inline uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f; /* IEEE round to nearest even */
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}

/* [Note: fp16 through F16C]
 * gcc 12 vectorises the _Float16 casts above only for AVX-512 targets. For AVX2 CPUs
 * (AMD Zen 1-3 and the like) every loop reading an fp16 gradient or writing an fp16 copy
 * stayed scalar ("control flow in loop"): several times its bf16 twin's time
 * (benchmarks/RESULTS.md, "The Adam kernel's fp16 paths on an AVX2 CPU"). Those CPUs have
 * F16C, whose VCVTPH2PS / VCVTPS2PH convert 8 elements in one instruction, but gcc will
 * not put them in a loop it vectorises itself. So on x86 with F16C and without AVX-512
 * the conversions move out of the loops, a block at a time: the fp32-moment update with
 * an fp16 gradient or an fp16 copy out runs in blocks of TZ_F16_BLOCK elements (the
 * block's gradient converted into an fp32 array on the stack, in L1; the fp32-gradient
 * loop run on it; the block's new parameters converted out), and the compressed-moment
 * and bf16-master kernels, already working in blocks of TZ_BLOCK, convert each block's
 * gradient into a stack array first and its copies out after. The same arithmetic on
 * the same values: results are bit for bit those of the one-pass loops. Subnormals:
 * VCVTPH2PS is not subject to DAZ, and VCVTPS2PH's fp16 subnormal results are not
 * flushed by FTZ (tests/offload/test_offload_adam_kernel.py checks both through the
 * kernel). Elsewhere (AVX-512, other architectures, a build without F16C) the casts stay
 * in the loops. */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define TZ_F16C 1
/* n elements between fp16 and fp32 with F16C; the tail one at a time with the same
 * instructions. Round to nearest even, no exception raised. */
static void f16_to_f32_n(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; ++i) f[i] = _cvtsh_ss(h[i]);
}

static void f32_to_f16_n(const float *f, uint16_t *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(f + i),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; ++i) h[i] = _cvtss_sh(f[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

/* grad kinds: 0 fp32, 1 bf16, 2 fp16;  out kinds: 0 none, 1 bf16, 2 fp16 */
static inline __attribute__((always_inline)) void adam_range(
    float *restrict p, float *restrict m, float *restrict v, const void *restrict gptr,
    void *restrict optr, int64_t lo, int64_t hi, const tz_adam_hp *hp,
    const int gkind, const int okind, const int decoupled, const int apply_decay,
    const int apply_scale, const int w_small) {
    const float *restrict g32 = (const float *)gptr;
    const uint16_t *restrict g16 = (const uint16_t *)gptr;
    uint16_t *restrict o16 = (uint16_t *)optr;
    const float scale = hp->grad_scale, decay = hp->decay, wd = hp->wd;
    const float wc = hp->w_coeff, b2 = hp->beta2, omb2 = hp->one_minus_beta2;
    const float bc2s = hp->bc2_sqrt, eps = hp->eps, nss = hp->neg_step_size;
    for (int64_t i = lo; i < hi; ++i) {
        float g = gkind == 0 ? g32[i] : gkind == 1 ? bf16_to_f32(g16[i]) : f16_to_f32(g16[i]);
        if (apply_scale) g = g * scale;
        float pi = p[i];
        if (apply_decay) {
            if (decoupled) pi = pi * decay;
            else g = fmaf(pi, wd, g);
        }
        float mi = m[i];
        mi = fmaf(wc, g - mi, w_small ? mi : g);
        float vi = v[i] * b2;
        vi = fmaf(omb2 * g, g, vi);
        float d = sqrtf(vi) / bc2s + eps;
        pi = pi + (nss * mi) / d;
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (okind == 1) o16[i] = f32_to_bf16(pi);
        else if (okind == 2) o16[i] = f32_to_f16(pi);
    }
}

/* One specialised loop per (grad kind, out kind, decay mode, scale, lerp branch):
 * every flag is a compile-time constant inside, so each loop vectorises cleanly. */
#define TZ_FLAGS(G, O)                                                                    \
    static void adam_##G##_##O(float *p, float *m, float *v, const void *g, void *o,    \
                               int64_t lo, int64_t hi, const tz_adam_hp *hp) {          \
        int mode = (hp->apply_decay ? (hp->decoupled ? 2 : 1) : 0);                     \
        int s = hp->apply_scale, ws = hp->w_small;                                      \
        if (mode == 0 && !s && ws) adam_range(p, m, v, g, o, lo, hi, hp, G, O, 0, 0, 0, 1); \
        else if (mode == 2 && !s && ws) adam_range(p, m, v, g, o, lo, hi, hp, G, O, 1, 1, 0, 1); \
        else if (mode == 0 && s && ws) adam_range(p, m, v, g, o, lo, hi, hp, G, O, 0, 0, 1, 1); \
        else if (mode == 2 && s && ws) adam_range(p, m, v, g, o, lo, hi, hp, G, O, 1, 1, 1, 1); \
        else if (mode == 1 && ws) adam_range(p, m, v, g, o, lo, hi, hp, G, O, 0, 1, s, 1);  \
        else adam_range(p, m, v, g, o, lo, hi, hp, G, O, mode == 2, mode != 0, s, 0);    \
    }

typedef void (*tz_adam_fn)(float *, float *, float *, const void *, void *, int64_t, int64_t,
                           const tz_adam_hp *);

TZ_FLAGS(0, 0)
TZ_FLAGS(0, 1)
TZ_FLAGS(1, 0)
TZ_FLAGS(1, 1)
#ifdef TZ_F16C /* [Note: fp16 through F16C] */
#define TZ_F16_BLOCK 512

static void adam_f16_blocks(tz_adam_fn body, int gkind, int okind, float *p, float *m,
                            float *v, const void *g, void *o, int64_t lo, int64_t hi,
                            const tz_adam_hp *hp) {
    float gbuf[TZ_F16_BLOCK];
    for (int64_t b = lo; b < hi; b += TZ_F16_BLOCK) {
        int64_t n = hi - b < TZ_F16_BLOCK ? hi - b : TZ_F16_BLOCK;
        const void *gb;
        if (gkind == 2) {
            f16_to_f32_n((const uint16_t *)g + b, gbuf, n);
            gb = gbuf;
        } else if (gkind == 1) {
            gb = (const uint16_t *)g + b;
        } else {
            gb = (const float *)g + b;
        }
        body(p + b, m + b, v + b, gb, okind == 1 ? (void *)((uint16_t *)o + b) : 0, 0, n, hp);
        if (okind == 2) f32_to_f16_n(p + b, (uint16_t *)o + b, n);
    }
}

#define TZ_F16(G, O, BG, BO)                                                              \
    static void adam_##G##_##O(float *p, float *m, float *v, const void *g, void *o,    \
                               int64_t lo, int64_t hi, const tz_adam_hp *hp) {          \
        adam_f16_blocks(adam_##BG##_##BO, G, O, p, m, v, g, o, lo, hi, hp);             \
    }
TZ_F16(0, 2, 0, 0)
TZ_F16(1, 2, 1, 0)
TZ_F16(2, 0, 0, 0)
TZ_F16(2, 1, 0, 1)
TZ_F16(2, 2, 0, 0)
#else
TZ_FLAGS(0, 2)
TZ_FLAGS(1, 2)
TZ_FLAGS(2, 0)
TZ_FLAGS(2, 1)
TZ_FLAGS(2, 2)
#endif

static const tz_adam_fn TZ_TABLE[3][3] = {
    {adam_0_0, adam_0_1, adam_0_2},
    {adam_1_0, adam_1_1, adam_1_2},
    {adam_2_0, adam_2_1, adam_2_2},
};

/* Update elements [lo, hi) in place. Returns 0, or -1 for a bad kind (the
 * Python side validates first; this is a last line of defence). */
int tz_adam_step(float *p, float *m, float *v, const void *g, int gkind, void *out, int okind,
                 int64_t lo, int64_t hi, const tz_adam_hp *hp) {
    if (gkind < 0 || gkind > 2 || okind < 0 || okind > 2 || (okind != 0 && out == 0)) return -1;
    unsigned mxcsr = tz_enter(); /* see [Note: subnormals] */
    TZ_TABLE[gkind][okind](p, m, v, g, out, lo, hi, hp);
    tz_leave(mxcsr);
    return 0;
}

/* Convert fp32 to bf16 (okind 1) or fp16 (okind 2), round to nearest even. */
int tz_f32_to_16(const float *src, void *dst, int okind, int64_t lo, int64_t hi) {
    uint16_t *o = (uint16_t *)dst;
    if (okind == 1) {
        for (int64_t i = lo; i < hi; ++i) o[i] = f32_to_bf16(src[i]);
    } else if (okind == 2) {
#ifdef TZ_F16C
        f32_to_f16_n(src + lo, o + lo, hi - lo);
#else
        for (int64_t i = lo; i < hi; ++i) o[i] = f32_to_f16(src[i]);
#endif
    } else {
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------
 * Compressed moments (offload.optimizer.state_precision; formats and codes in
 * offload/state_codec.py, [Note: 8-bit moment codes]). The same one pass as
 * tz_adam_step: each element's stored moments are decoded, updated with exactly the
 * arithmetic above, and the new ones re-encoded before moving on. skind 1: bf16 moments
 * (m, v as bf16, rounded stochastically). skind 2: int8 blocks of TZ_BLOCK elements: the
 * block's new m and sqrt(v) are kept in two stack arrays (2 KiB, in L1) until the block's
 * maximum is known, then encoded; nothing is read or written twice in memory. The fp32
 * path above is untouched, so fp32 results are bit-identical to before this was added.
 * ------------------------------------------------------------------------------------ */
#define TZ_BLOCK 256

/* murmur3's 32-bit finaliser: the counter-based random bits of stochastic rounding. */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* Element i's random bits under a moment's key (state_codec.random_bits); `i32` is the
 * element's index modulo 2^32, all the hash takes of it. The loop below counts it in 32
 * bits from each block's first element: the same bits as truncating the 64-bit index,
 * without 64-bit lanes in the vectorised loop to add and narrow (the kernel's time before
 * and after: benchmarks/RESULTS.md, "The int8 moment encode on AVX2"). */
static inline uint32_t rbits(uint32_t i32, uint32_t key) {
    return fmix32((i32 * 0x9e3779b1u) ^ key);
}

/* [Note: int8 decode by arithmetic]
 * The reference decodes code q through a table, (code value of q) / top in fp32
 * (state_codec.M_TABLE / U_TABLE), times the block scale. With AVX-512 (and on other
 * architectures) the kernel computes the same fp32 values from q's bits instead, in the
 * update's vectorised loop (without AVX-512, see the next note):
 *   code value: e = q >> mb, f = q & (2^mb - 1); the integer significand k = 2^mb + f
 *     (e > 0) or f (e = 0, the linear range) times 2^(max(e, 1) - 15 - mb), a power of
 *     two built from its bits: one exact float product. Only integer selects, so gcc
 *     if-converts it (it does not speculate float operations under a branch).
 *   / top: x * r with r = fl(1 / top), then one fused correction (Markstein:
 *     fma(fma(-q0, top, x), r, q0)). The plain product is an ulp off for 3 of exp_avg's 8
 *     and 4 of sqrt(v)'s 16 mantissas; the corrected one equals the correctly rounded
 *     x / top for all of them (checked exactly), and the exponent only scales the result
 *     (none is subnormal), so every one of the 128 + 256 values equals the table's. It is
 *     cheaper than a division: the update already keeps the divider busy twice per
 *     element. tests/offload/test_offload_state_codec.py decodes all codes of both
 *     moments through the kernel and compares them with the tables. */
static inline float dec_mag(uint32_t q, const int mb) {
    const float top = mb == 3 ? 1.875f : 1.9375f;
    const float r = mb == 3 ? 1.0f / 1.875f : 1.0f / 1.9375f; /* fl(1 / top) */
    uint32_t e = q >> mb, f = q & ((1u << mb) - 1u);
    uint32_t k = e ? f + (1u << mb) : f;
    uint32_t pb = ((e ? e : 1u) + 112u - (uint32_t)mb) << 23; /* 2^(max(e,1) - 15 - mb) */
    float pow2;
    memcpy(&pow2, &pb, sizeof pow2);
    float x = (float)(int32_t)k * pow2;
    float q0 = x * r;
    return fmaf(fmaf(-q0, top, x), r, q0);
}

/* [Note: int8 decode through a table without AVX-512]
 * With AVX-512 the arithmetic above runs on 16 codes per instruction and stays (a table
 * was not measured there). With 4-lane SSE / AVX2 vectors (AMD Zen 1-3, Intel CPUs without
 * AVX-512) loading each code's value from a 256-entry table (1 KiB, in L1) costs less
 * than that arithmetic: a block's codes are decoded into a stack array before the
 * update's loop, four table loads gathered into one vector and multiplied by the block
 * scale (benchmarks/RESULTS.md, "The int8 decode through a table on an AVX2 CPU"). The
 * loads are written as intrinsics, not left for gcc to vectorise: for Intel AVX2 targets
 * it would use VGATHERDPS, slow on CPUs with the gather-data-sampling microcode fix.
 * The tables hold exactly dec_mag's values (with exp_avg's sign: -(x * s) = (-x) * s in
 * round-to-nearest), filled by it when the library is loaded, so the decoded moments are
 * bit for bit the arithmetic's (a NaN block scale, a non-finite block's, decodes to NaN
 * either way, its sign aside; tests/offload/test_offload_state_kernel_codes.py decodes
 * every code of both moments through the kernel). */
#if defined(__SSE2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define TZ_DEC_TABLE 1
static float tz_m_table[256], tz_u_table[256]; /* exp_avg's signed codes; sqrt(v)'s */

__attribute__((constructor)) static void tz_fill_dec_tables(void) {
    for (uint32_t q = 0; q < 256; ++q) {
        float mag = dec_mag(q & 0x7fu, 3);
        tz_m_table[q] = (q & 0x80u) ? -mag : mag;
        tz_u_table[q] = dec_mag(q, 4);
    }
}

/* out[j] = t[q[j]] * s for j < n */
static inline void dec_block(const uint8_t *restrict q, const float *restrict t, float s,
                             float *restrict out, int n) {
    const __m128 vs = _mm_set1_ps(s);
    int j = 0;
    for (; j + 4 <= n; j += 4)
        _mm_storeu_ps(out + j, _mm_mul_ps(_mm_setr_ps(t[q[j]], t[q[j + 1]], t[q[j + 2]],
                                                      t[q[j + 3]]), vs));
    for (; j < n; ++j) out[j] = t[q[j]] * s;
}
#endif

/* Magnitude y >= 0 -> nearest code, ties to even, clamped to the top code. The linear
 * range (y < 2^-14) rounds y * 2^(14 + mb) to an integer, ties to even, by one float add:
 * fl(y + 2^(9 - mb)) has ulp 2^-(14 + mb), so its bits minus those of 2^(9 - mb) are that
 * integer (cheaper than a multiply, a round and a conversion; same result). Both results
 * are picked by a bit mask, not `?:`: gcc sinks the float add into the branch that uses
 * it, and without AVX-512's masked operations it will not speculate a float add out of a
 * branch (it could trap), so on AVX2 targets the whole encode loop stayed scalar (int8
 * moments 1.8x slower a step on a Zen 1 CPU; RESULTS.md). */
static inline uint32_t enc_mag(float y, const int mb) {
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    const int sh = 23 - mb;
    int32_t normal = (int32_t)((bits + ((1u << (sh - 1)) - 1u) + ((bits >> sh) & 1u)) >> sh)
                     - (112 << mb);
    const float c = mb == 3 ? 64.0f : 32.0f; /* 2^(9 - mb) */
    float yc = y + c;
    uint32_t ycb, cb;
    memcpy(&ycb, &yc, sizeof ycb);
    memcpy(&cb, &c, sizeof cb);
    int32_t sub = (int32_t)(ycb - cb);
    int32_t lin = -(int32_t)(y < 0x1p-14f); /* all bits set in the linear range */
    int32_t q = (sub & lin) | (normal & ~lin);
    const int32_t top = (1 << (4 + mb)) - 1;
    return (uint32_t)(q < 0 ? 0 : (q > top ? top : q));
}

/* fp32 -> bf16 rounded stochastically with the low 16 of r; NaN becomes 0x7fc0. */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t rounded = (u + (r & 0xffffu)) >> 16;
    return (uint16_t)(is_nan ? 0x7fc0u : rounded);
}

/* The block's scale (its largest magnitude, 0 for a zero or subnormal block) and the
 * factor that maps it to the top code `top` (state_codec._block_scale). */
static inline void block_scale(float absmax, float top, float *scale, float *inv) {
    int ok = absmax >= 0x1p-126f;
    *scale = ok ? absmax : 0.0f;
    *inv = ok ? top / absmax : 0.0f;
}

static inline __attribute__((always_inline)) void adam_q_range(
    void *restrict pptr, void *restrict mraw, float *restrict ms, void *restrict vraw,
    float *restrict vs, const void *restrict gptr, void *restrict optr, int64_t lo, int64_t hi,
    const tz_adam_hp *hp, const int64_t base,
    const uint32_t key_m, const uint32_t key_v, const uint32_t key_p, const int pkind,
    const int skind,
    const int gkind, const int okind, const int decoupled, const int apply_decay,
    const int apply_scale, const int w_small) {
    float *restrict p = (float *)pptr;
    uint16_t *restrict pb = (uint16_t *)pptr;
    float *restrict m32 = (float *)mraw;
    float *restrict v32 = (float *)vraw;
    const float *restrict g32 = (const float *)gptr;
    const uint16_t *restrict g16 = (const uint16_t *)gptr;
    uint16_t *restrict o16 = (uint16_t *)optr;
    uint16_t *restrict m16 = (uint16_t *)mraw;
    uint16_t *restrict v16 = (uint16_t *)vraw;
    uint8_t *restrict mq = (uint8_t *)mraw;
    uint8_t *restrict vq = (uint8_t *)vraw;
    const float scale = hp->grad_scale, decay = hp->decay, wd = hp->wd;
    const float wc = hp->w_coeff, b2 = hp->beta2, omb2 = hp->one_minus_beta2;
    const float bc2s = hp->bc2_sqrt, eps = hp->eps, nss = hp->neg_step_size;
    for (int64_t b0 = lo; b0 < hi; b0 += TZ_BLOCK) {
        const int len = (int)(hi - b0 < TZ_BLOCK ? hi - b0 : TZ_BLOCK);
        float mt[TZ_BLOCK], ut[TZ_BLOCK];
        float sm = 0.0f, sv = 0.0f;
#ifdef TZ_F16C
        /* fp16 gradients in and fp16 copies out through stack arrays, converted a block
         * at a time ([Note: fp16 through F16C]) */
        float gt[TZ_BLOCK], pt[TZ_BLOCK];
        if (gkind == 2) f16_to_f32_n(g16 + b0, gt, len);
#endif
#ifdef TZ_DEC_TABLE
        float md[TZ_BLOCK], ud[TZ_BLOCK]; /* the block's decoded m and sqrt(v) */
#endif
        if (skind == 2) {
            sm = ms[b0 / TZ_BLOCK];
            sv = vs[b0 / TZ_BLOCK];
#ifdef TZ_DEC_TABLE
            dec_block(mq + b0, tz_m_table, sm, md, len);
            dec_block(vq + b0, tz_u_table, sv, ud, len);
#endif
        }
        const uint32_t r0 = (uint32_t)(b0 + base); /* rbits' index of element b0 */
        for (int j = 0; j < len; ++j) {
            const int64_t i = b0 + j;
            const uint32_t ri = r0 + (uint32_t)j;
#ifdef TZ_F16C
            float g = gkind == 0 ? g32[i] : gkind == 1 ? bf16_to_f32(g16[i]) : gt[j];
#else
            float g = gkind == 0 ? g32[i] : gkind == 1 ? bf16_to_f32(g16[i])
                                                       : f16_to_f32(g16[i]);
#endif
            if (apply_scale) g = g * scale;
            float pi = pkind == 1 ? bf16_to_f32(pb[i]) : p[i];
            if (apply_decay) {
                if (decoupled) pi = pi * decay;
                else g = fmaf(pi, wd, g);
            }
            float mi, vi;
            if (skind == 0) {
                mi = m32[i];
                vi = v32[i];
            } else if (skind == 1) {
                mi = bf16_to_f32(m16[i]);
                vi = bf16_to_f32(v16[i]);
            } else {
#ifdef TZ_DEC_TABLE
                mi = md[j]; /* see [Note: int8 decode through a table without AVX-512] */
                float u = ud[j];
#else
                uint32_t c = mq[i]; /* see [Note: int8 decode by arithmetic] */
                float mag = dec_mag(c & 0x7fu, 3) * sm;
                mi = (c & 0x80u) ? -mag : mag;
                float u = dec_mag(vq[i], 4) * sv;
#endif
                vi = u * u;
            }
            mi = fmaf(wc, g - mi, w_small ? mi : g);
            vi = vi * b2;
            vi = fmaf(omb2 * g, g, vi);
            float su = sqrtf(vi);
            float d = su / bc2s + eps;
            pi = pi + (nss * mi) / d;
            if (pkind == 1) pb[i] = f32_to_bf16_sr(pi, rbits(ri, key_p));
            else p[i] = pi;
            if (skind == 0) {
                m32[i] = mi;
                v32[i] = vi;
            } else if (skind == 1) {
                m16[i] = f32_to_bf16_sr(mi, rbits(ri, key_m));
                v16[i] = f32_to_bf16_sr(vi, rbits(ri, key_v));
            } else {
                mt[j] = mi;
                ut[j] = su;
            }
            if (okind == 1) o16[i] = f32_to_bf16(pi);
#ifdef TZ_F16C
            else if (okind == 2) pt[j] = pi;
#else
            else if (okind == 2) o16[i] = f32_to_f16(pi);
#endif
        }
#ifdef TZ_F16C
        if (okind == 2) f32_to_f16_n(pt, o16 + b0, len);
#endif
        if (skind == 2) {
            /* The largest magnitudes, as integers: the bits of non-negative floats order
             * as they do (this reduction vectorises; a float max does not without
             * -ffast-math), and NaN / inf are the bit patterns above the largest finite. */
            uint32_t amb = 0, aub = 0;
            for (int j = 0; j < len; ++j) {
                uint32_t a, u;
                memcpy(&a, &mt[j], sizeof a);
                memcpy(&u, &ut[j], sizeof u);
                a &= 0x7fffffffu;
                u &= 0x7fffffffu;
                amb = a > amb ? a : amb;
                aub = u > aub ? u : aub;
            }
            int bad_m = amb > 0x7f7fffffu, bad_u = aub > 0x7f7fffffu; /* NaN or inf */
            float am, au;
            memcpy(&am, &amb, sizeof am);
            memcpy(&au, &aub, sizeof au);
            float scm, invm, scu, invu;
            block_scale(am, 1.875f, &scm, &invm);
            block_scale(au, 1.9375f, &scu, &invu);
            for (int j = 0; j < len; ++j) {
                uint32_t q = enc_mag(fabsf(mt[j]) * invm, 3);
                mq[b0 + j] = (uint8_t)(q | ((mt[j] < 0.0f && q) ? 0x80u : 0u));
                vq[b0 + j] = (uint8_t)enc_mag(ut[j] * invu, 4);
            }
            ms[b0 / TZ_BLOCK] = bad_m ? NAN : scm;
            vs[b0 / TZ_BLOCK] = bad_u ? NAN : scu;
        }
    }
}

#define TZ_QFLAGS(S, G, O)                                                                    \
    static void adamq_##S##_##G##_##O(float *p, void *m, float *ms, void *v, float *vs,       \
                                      const void *g, void *o, int64_t lo, int64_t hi,         \
                                      const tz_adam_hp *hp, int64_t base, uint32_t km,         \
                                      uint32_t kv) {                                          \
        int mode = (hp->apply_decay ? (hp->decoupled ? 2 : 1) : 0);                           \
        int s = hp->apply_scale, ws = hp->w_small;                                            \
        if (mode == 0 && !s && ws)                                                            \
            adam_q_range(p, m, ms, v, vs, g, o, lo, hi, hp, base, km, kv, 0u, 0, S, G, O, 0, 0, 0, 1);             \
        else if (mode == 2 && !s && ws)                                                       \
            adam_q_range(p, m, ms, v, vs, g, o, lo, hi, hp, base, km, kv, 0u, 0, S, G, O, 1, 1, 0, 1);             \
        else if (mode == 0 && s && ws)                                                        \
            adam_q_range(p, m, ms, v, vs, g, o, lo, hi, hp, base, km, kv, 0u, 0, S, G, O, 0, 0, 1, 1);             \
        else if (mode == 2 && s && ws)                                                        \
            adam_q_range(p, m, ms, v, vs, g, o, lo, hi, hp, base, km, kv, 0u, 0, S, G, O, 1, 1, 1, 1);             \
        else                                                                                  \
            adam_q_range(p, m, ms, v, vs, g, o, lo, hi, hp, base, km, kv, 0u, 0, S, G, O, mode == 2, mode != 0, s, \
                         ws);                                                                 \
    }
#define TZ_QROW(S, G) TZ_QFLAGS(S, G, 0) TZ_QFLAGS(S, G, 1) TZ_QFLAGS(S, G, 2)
TZ_QROW(1, 0)
TZ_QROW(1, 1)
TZ_QROW(1, 2)
TZ_QROW(2, 0)
TZ_QROW(2, 1)
TZ_QROW(2, 2)

typedef void (*tz_adamq_fn)(float *, void *, float *, void *, float *, const void *, void *,
                            int64_t, int64_t, const tz_adam_hp *, int64_t, uint32_t, uint32_t);

static const tz_adamq_fn TZ_QTABLE[2][3][3] = {
    {{adamq_1_0_0, adamq_1_0_1, adamq_1_0_2},
     {adamq_1_1_0, adamq_1_1_1, adamq_1_1_2},
     {adamq_1_2_0, adamq_1_2_1, adamq_1_2_2}},
    {{adamq_2_0_0, adamq_2_0_1, adamq_2_0_2},
     {adamq_2_1_0, adamq_2_1_1, adamq_2_1_2},
     {adamq_2_2_0, adamq_2_2_1, adamq_2_2_2}},
};

/* Update elements [lo, hi) of a shard whose moments are stored compressed. m / v: the
 * moments' bf16 data (skind 1) or int8 codes (skind 2, with their per-block scales ms / vs,
 * indexed from element 0 of the shard; codes decode as [Note: int8 decode by arithmetic]
 * says). seed, base: bf16 moments are rounded stochastically with random bits of
 * (seed, base + element index), so a step is reproducible and a shard stored in pieces
 * (base: the piece's first element) rounds as one; int8 rounds to nearest. For skind 2, lo
 * must be a multiple of TZ_BLOCK and hi a multiple of it or the shard's end. Returns 0, or
 * -1 for a bad kind / range. */
int tz_adam_step_q(float *p, void *m, float *ms, void *v, float *vs, const void *g, int gkind,
                   void *out, int okind, int skind, int64_t lo, int64_t hi,
                   const tz_adam_hp *hp, uint32_t seed, int64_t base) {
    if (gkind < 0 || gkind > 2 || okind < 0 || okind > 2 || (okind != 0 && out == 0)) return -1;
    if (skind < 1 || skind > 2 || (skind == 2 && (lo % TZ_BLOCK != 0 || ms == 0 || vs == 0)))
        return -1;
    unsigned mxcsr = tz_enter(); /* see [Note: subnormals] */
    /* the moments' keys for this call's stochastic rounding (state_codec.moment_keys) */
    uint32_t km = fmix32(seed * 2u + 1u), kv = fmix32(seed * 2u + 2u);
    TZ_QTABLE[skind - 1][gkind][okind](p, m, ms, v, vs, g, out, lo, hi, hp, base, km, kv);
    tz_leave(mxcsr);
    return 0;
}

/* ------------------------------------------------------------------------------------
 * bf16 master weights (offload.optimizer.master_precision bf16; offload/bf16_master.py,
 * [Note: bf16 master weights]): the parameter itself is the bf16 compute copy. Each element
 * is read as bf16, updated in fp32 with exactly the arithmetic above (moments in any of the
 * three storage kinds, skind 0 fp32 / 1 bf16 / 2 int8), and written back as bf16 rounded
 * stochastically: the random bits of (key_p, base + element index) are added below the
 * bf16 mantissa and the low 16 bits truncated (f32_to_bf16_sr, the idea of torchao's
 * bf16_stochastic_round). No low-precision copy is written (the param is that copy).
 * The fp32-master paths above are instantiated with pkind 0, untouched.
 * ------------------------------------------------------------------------------------ */
#define TZ_BFLAGS(S, G)                                                                       \
    static void adamb_##S##_##G(uint16_t *p, void *m, float *ms, void *v, float *vs,          \
                                const void *g, int64_t lo, int64_t hi, const tz_adam_hp *hp,  \
                                int64_t base, uint32_t km, uint32_t kv, uint32_t kp) {        \
        int mode = (hp->apply_decay ? (hp->decoupled ? 2 : 1) : 0);                           \
        int s = hp->apply_scale, ws = hp->w_small;                                            \
        if (mode == 0 && !s && ws)                                                            \
            adam_q_range(p, m, ms, v, vs, g, 0, lo, hi, hp, base, km, kv, kp, 1, S, G, 0, 0, 0, 0, 1); \
        else if (mode == 2 && !s && ws)                                                       \
            adam_q_range(p, m, ms, v, vs, g, 0, lo, hi, hp, base, km, kv, kp, 1, S, G, 0, 1, 1, 0, 1); \
        else if (mode == 0 && s && ws)                                                        \
            adam_q_range(p, m, ms, v, vs, g, 0, lo, hi, hp, base, km, kv, kp, 1, S, G, 0, 0, 0, 1, 1); \
        else if (mode == 2 && s && ws)                                                        \
            adam_q_range(p, m, ms, v, vs, g, 0, lo, hi, hp, base, km, kv, kp, 1, S, G, 0, 1, 1, 1, 1); \
        else                                                                                  \
            adam_q_range(p, m, ms, v, vs, g, 0, lo, hi, hp, base, km, kv, kp, 1, S, G, 0,     \
                         mode == 2, mode != 0, s, ws);                                        \
    }
#define TZ_BROW(S) TZ_BFLAGS(S, 0) TZ_BFLAGS(S, 1) TZ_BFLAGS(S, 2)
TZ_BROW(0)
TZ_BROW(1)
TZ_BROW(2)

typedef void (*tz_adamb_fn)(uint16_t *, void *, float *, void *, float *, const void *,
                            int64_t, int64_t, const tz_adam_hp *, int64_t, uint32_t, uint32_t,
                            uint32_t);

static const tz_adamb_fn TZ_BTABLE[3][3] = {
    {adamb_0_0, adamb_0_1, adamb_0_2},
    {adamb_1_0, adamb_1_1, adamb_1_2},
    {adamb_2_0, adamb_2_1, adamb_2_2},
};

/* Update elements [lo, hi) of a shard whose master is the bf16 param `p` (rounded
 * stochastically with key_p, see above). m / v: fp32 moments (skind 0) or stored as
 * tz_adam_step_q takes them (skind 1, 2; seed as there); base: the piece's first element
 * in its shard, for every random bit. For skind 2, lo must be a multiple of TZ_BLOCK.
 * Returns 0, or -1 for a bad kind / range. */
int tz_adam_step_b(uint16_t *p, void *m, float *ms, void *v, float *vs, const void *g,
                   int gkind, int skind, int64_t lo, int64_t hi, const tz_adam_hp *hp,
                   uint32_t seed, int64_t base, uint32_t key_p) {
    if (gkind < 0 || gkind > 2 || skind < 0 || skind > 2) return -1;
    if (skind == 2 && (lo % TZ_BLOCK != 0 || ms == 0 || vs == 0)) return -1;
    unsigned mxcsr = tz_enter(); /* see [Note: subnormals] */
    uint32_t km = fmix32(seed * 2u + 1u), kv = fmix32(seed * 2u + 2u);
    TZ_BTABLE[skind][gkind](p, m, ms, v, vs, g, lo, hi, hp, base, km, kv, key_p);
    tz_leave(mxcsr);
    return 0;
}

int tz_state_block(void) { return TZ_BLOCK; }
