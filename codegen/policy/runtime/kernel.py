"""The grouped matmul of a decode step's routed experts, as one C loop over the experts that have rows.

A decode step routes each token to a few experts, so every expert's matmul has 1-16 rows: a matrix-vector
product that should stream the expert's weights from memory once. torch's CPU matmul runs such products at a third
of the machine's read bandwidth and pays ~7 us of dispatch each, and a batch-16 step of toy Qwen3-MoE widths issues
~670 of them. This kernel visits every expert with 1..`SMALL_GROUP_ROWS` rows in one call, streaming each weight in
its memory order; bfloat16 experts with more rows (prefill) are left to torch's matmul, float32 ones run the loops
below. Measured (toy Qwen3-MoE widths, batch 16, its 4 layers' experts, float32, one thread): 7.4 ms against 20.3 ms
with torch's matmul per expert, 6.9 ms to only read the weights; its compiled decode step on 2 ranks went from 28 to
17 ms. Weights stored row-major (input
dim first, as GPT-OSS keeps them and as the fused experts store every float32 expert) are applied, up to 4 rows,
eight weight rows at a time to sums that stay in cache, so the weight streams in long runs (`by_weight_rows_streamed`;
bfloat16 ones of any rows so too: on an Intel Xeon (AVX-512), one thread, GPT-OSS-20b's experts at TP=2 widths went
from 8.7 to 14.2 GB/s at batch 1 and from 6.4 to 10.0 at batch 16, where torch reads 11-12 GB/s); float32 experts
with more rows go to a blocked loop (8 rows by 48 columns in registers, `by_weight_rows_blocked`), which outruns
BLAS's sgemm at every row count measured. float32 weights stored column-major (output dim first, the (E, out, in)
experts as transformers keeps them) go through the dense loop below, expert by expert, past 64 rows in chunks of at
most 64 (scripts/experts_kernel_bench.py at the published widths, decode steps: 0.94-1.17x torch's matmul per expert,
where the column loop before it was 0.76-1.01x), as a long prompt's dense products do. bfloat16
weights are read as they are and summed in float32 (the rows converted to float32 first): transformers runs
`torch._grouped_mm` in bfloat16, whose CPU kernel visits every expert (the same script: this loop is 1.42-1.89x it
at batch 1, 1.05-1.22x at batch 16).

The same library holds the fused experts (`fused_experts`, codegen.policy.runtime.experts_implementation): a whole
MoE layer's routed experts in one call, each expert's rows gathered, multiplied by gate-up, gated, multiplied by down
and added into their tokens' sums while they are in cache, through the loops above: the experts with few rows
together, each of the others alone.

And the dense loop (`linear_rows`, codegen.policy.runtime.compiled's `codegen::linear_rows`): a decode step's 1-16
rows by an nn.Linear weight (out, in), in float32. torch's BLAS reads a 16-row product's weight at a third of the
read bandwidth (MKL: 35-47 GFLOP/s on one thread); this loop keeps a tile of 4 rows by 6 weight rows in vector
registers. Measured on an Intel Xeon (AVX-512), one thread, a weight of 5472x2048 (DeepSeek-V2-Lite's dense MLP
projection at TP=2): 16 rows 9.3 -> 5.8 ms, 8 rows 9.0 -> 3.8, 4 rows 6.7 -> 3.4, 1 row 3.3 -> 3.3; its compiled
decode step at batch 16 on 2 ranks (full widths, 2 layers) went from 119-129 to 104-108 ms. From 9 rows on the rows
are one vector's lanes (`linear_lanes_span`): the tile's reloads of x from L2 stalled the weight's stream (16 rows, a
full-width Qwen1.5-MoE layer's dense products streamed from memory: 12.0 -> 9.0-9.5 ms). From 17 to 64 rows (a
short prompt's prefill) they are the lanes of 2-4 vectors (`linear_wide_span`), where torch's BLAS packs the weight on
every call: the same products at 64 rows, 33-37 -> 27 ms, in chunks of 64 from there on. A prompt of `ONEDNN_ROWS`
rows or more by a weight under 4 MiB is oneDNN's sgemm, which outruns both the loop and torch's MKL there on an AMD
EPYC with AVX-512 (on a CPU without it, torch's MKL: `ONEDNN_OUTRUNS_TORCH`).

And eager attention (codegen.policy.runtime.eager_attention): a decode step's (`decode_attention`: one new token
per row over its cached keys, each kv head's keys and values read once for its query heads) and a prefill's
(`prefill_attention`: blocks of query rows over the keys they do not all mask, by sgemm), with optional per-head
sinks (GPT-OSS's), e^x in vector registers.

It is built once per machine (the system C compiler, `-O3 -march=native`, OpenMP on torch's own runtime) into this
environment's build dir, keyed by its source, the compiler and the CPU; where it cannot be built, the caller runs
torch's matmul per expert and says why once. The figures above are from CPUs with AVX-512, where its vectors are 16
floats; elsewhere (AVX2, Arm) they are 8 and its tiles hold half the sums, sized for 16 registers (the C source's
`LANES`), and from `NARROW_DENSE_ROWS` rows on torch's BLAS runs the dense products.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import torch  # first: the kernel's OpenMP threads run on the runtime torch loaded (one libgomp per process)

from codegen.policy.runtime.base import GATE_CLAMPED_SWIGLU, GATE_SILU
from codegen.policy.runtime.environment import extensions_dir

#: bfloat16 experts with at most this many rows go to the kernel; more (prefill) go to torch's matmul, which packs
#: the weight once and wins from there on (float32 experts of any rows go to the kernel)
SMALL_GROUP_ROWS = 16

#: the most rows the dense loop (`linear_rows`) takes in one pass over the weight (a decode step's, a short prompt's);
#: a longer prompt's go in chunks of at most this many (its products are bound by the multiply-adds from 17 rows on,
#: where torch's BLAS packs the weight on every call; measured)
DENSE_KERNEL_ROWS = 64
#: the least elements of a weight the kernel takes `ONEDNN_ROWS` or more rows by (4 MiB in float32): it streams a
#: weight that large from memory faster than BLAS packs it (1024 rows by a full-width Qwen1.5-MoE layer's dense
#: weights: 102-108 GFLOP/s against 90-99)
DENSE_KERNEL_WIDE_WEIGHT = 1 << 20
#: the least rows of a float32 product by a smaller weight that go to oneDNN's sgemm (which outruns torch's MKL there
#: on an AMD EPYC: 0.95-1.27x); fewer go to the kernel's dense loop, whatever the weight. In an MoE model a dense
#: weight is read from memory at every forward (the experts between two uses of it overflow the caches), and read so
#: the loop outruns oneDNN up to a few hundred rows: the same machine, one thread, weights of 60x512 to 4096x256 from
#: memory in huge pages, 32 / 64 / 128 / 256 rows: 1.4-1.7x / 1.2-1.5x / 1.0-1.3x / 1.0-1.2x, 512 rows 0.95-1.1x,
#: 1024 rows 0.95-1.1x (a weight in cache, as a dense model's may be, went the other way: 0.7-1.0x of torch's BLAS)
ONEDNN_ROWS = 512
#: the least rows of any float32 product that go to torch where the kernel's vectors are 8 floats (AVX2, Arm; 16 with
#: AVX-512): there torch's BLAS packs a weight for 8-float registers as fast as the dense loop streams it. Measured on
#: an AMD EPYC (AVX2), one thread, weights of 60x512 to 768x512 from memory, the loop against torch's MKL: 16 rows
#: 1.45-1.64x, 32 rows 0.88-1.28x, 64 rows 0.79-1.01x, 128-511 rows 0.77-0.89x
NARROW_DENSE_ROWS = 64
#: whether this torch has oneDNN's linear op (torch's x86 and Arm CPU wheels do; inductor uses it)
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
#: whether oneDNN's sgemm outruns torch's own product on this CPU from `ONEDNN_ROWS` rows: with AVX-512 (as ATen's
#: dispatch reads the CPU), not elsewhere. On an AMD EPYC with AVX2 only, one thread, weights from memory, oneDNN took
#: 1.06-1.17x MKL's time summed over a row count's weights (2048 and 512 rows by 128x512 to 2048x1024; 1024 and 512
#: rows by the full widths' 256x2048 to 5472x2048 at TP=2), and longer in 46 of the 52 products (0.93-1.27x each)
ONEDNN_OUTRUNS_TORCH = torch.backends.cpu.get_cpu_capability() == "AVX512"


#: the torch.library Libraries the runtime's ops are defined through, alive as long as the process (their ops go
#: with them)
_LIBRARIES: list = []


def define_op(name, arguments, impl, fake, returns="Tensor"):
    """The op `name` ("codegen::x"), taking `arguments` (a schema's, e.g. "Tensor input, Tensor? bias") and
    returning `returns` (one new Tensor; "()" for an op that writes into an argument marked `Tensor(a!)`): run by
    `impl`, traced by torch.compile through `fake`, opaque to it.

    Defined through torch.library's Library, not `custom_op`: a decode step runs 20-40 of these ops, and
    `custom_op`'s Python wrapper costs about 9 us a call where the Library's dispatch costs 3 (measured on the Xeon,
    torch 2.13)."""
    namespace, op = name.split("::")
    library = torch.library.Library(namespace, "FRAGMENT")
    _LIBRARIES.append(library)
    library.define(f"{op}({arguments}) -> {returns}")
    library.impl(op, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(name, lib=library)(fake)


_HEAD = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

#if !defined(MAX_ROWS) || !defined(WIDE_ROWS)
#error "build with -DMAX_ROWS=<SMALL_GROUP_ROWS> -DWIDE_ROWS=<DENSE_KERNEL_ROWS>"
#endif
#define ACC_FLOATS 4096  /* one task's accumulators (rows x columns, 16 KiB): they stay in L1 */
#define MIN_BLOCK 64
/* the largest weight of one expert whose successor (the next expert with rows) the row-major loops fetch into L2
   while they sum this one, in its memory order: two fit in L2 beside the rows, and a prefill's few rows per expert
   then run from cache, where each expert's weight started cold. Measured on the AMD EPYC (AVX-512), one thread, a
   128-token prompt's experts at the toy widths (hidden 512, experts of 64 at TP=2, 5-9 rows each): 2.2-5.5 ->
   1.7-4.5 ms a layer (Qwen1.5-MoE, DeepSeek-V2, Qwen3-MoE; GPT-OSS and Qwen3.5, 16 rows each: 4-7%); decode
   steps and 2048-token prompts unchanged. A published width's expert (several MiB) keeps the loops' own
   look-ahead. */
#define PREFETCH_NEXT_BYTES (512 * 1024)
#if MAX_ROWS * MIN_BLOCK > ACC_FLOATS
#error "MAX_ROWS rows of MIN_BLOCK columns must fit in ACC_FLOATS"
#endif

/* start and end row of expert e: offs holds each group's end (int32 or int64) */
static inline void group(const void *offs, int offs64, int64_t e, int64_t *start, int64_t *end) {
    if (offs64) { *start = e ? ((const int64_t *)offs)[e - 1] : 0; *end = ((const int64_t *)offs)[e]; }
    else { *start = e ? ((const int32_t *)offs)[e - 1] : 0; *end = ((const int32_t *)offs)[e]; }
}

/* a bfloat16 is the high half of a float32 */
static inline float f32_of_bf16(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
"""

#: the task shapes, for one weight element type: `WEIGHT` the C type, `LOAD(v)` its value as a float, `TYPE` the
#: functions' suffix. The rows (x) and the sums are float32 whatever the weights are.
_ROWS_TASK = r"""
/* weight row-major (w[k * sk + n]): four weight rows at a time are applied to each row's accumulators, which stay
   in L1; a block spans as many columns as fit, so the weight streams in long runs */
static void by_weight_rows_TYPE(const float *x, int64_t ldx, const WEIGHT *w, int64_t sk, int64_t K, int64_t rows,
                                int64_t nb, float *out, int64_t ldo) {
    float acc[ACC_FLOATS];
    memset(acc, 0, rows * nb * sizeof(float));
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {
        const WEIGHT *w0 = w + k * sk, *w1 = w0 + sk, *w2 = w1 + sk, *w3 = w2 + sk;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * ldx + k;
            const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
            float *a = acc + r * nb;
            #pragma omp simd
            for (int64_t n = 0; n < nb; n++)
                a[n] += x0 * LOAD(w0[n]) + x1 * LOAD(w1[n]) + x2 * LOAD(w2[n]) + x3 * LOAD(w3[n]);
        }
    }
    for (; k < K; k++) {
        const WEIGHT *wk = w + k * sk;
        for (int64_t r = 0; r < rows; r++) {
            const float xv = x[r * ldx + k];
            float *a = acc + r * nb;
            #pragma omp simd
            for (int64_t n = 0; n < nb; n++) a[n] += xv * LOAD(wk[n]);
        }
    }
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * ldo, acc + r * nb, nb * sizeof(float));
}

"""

#: bfloat16 weights with the input dim contiguous, column by column (float32 ones go through the dense loop)
_COLUMNS_TASK = r"""
/* weight column-major (w[n * sn + k]), bfloat16: a column at a time, read once for up to four rows (four
   independent sums; weight columns read side by side stream several times slower: measured). A column of at most a
   page has the next one prefetched while it is summed (measured: columns of 2048 went from 7 to 10 GB/s) */
static void by_weight_columns_TYPE(const float *x, int64_t ldx, const WEIGHT *w, int64_t sn, int64_t K,
                                   int64_t rows, int64_t nb, float *out, int64_t ldo) {
    const int64_t line = 64 / sizeof(WEIGHT), prefetch = sn * (int64_t)sizeof(WEIGHT) <= 4096;
    for (int64_t n = 0; n < nb; n++) {
        const WEIGHT *wn = w + n * sn;
        if (prefetch && n + 1 < nb)
            for (int64_t k = 0; k < K; k += line) __builtin_prefetch(wn + sn + k, 0, 1);
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {
            const float *x0 = x + r * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            #pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int64_t k = 0; k < K; k++) {
                const float wk = LOAD(wn[k]);
                s0 += x0[k] * wk; s1 += x1[k] * wk; s2 += x2[k] * wk; s3 += x3[k] * wk;
            }
            out[r * ldo + n] = s0; out[(r + 1) * ldo + n] = s1; out[(r + 2) * ldo + n] = s2;
            out[(r + 3) * ldo + n] = s3;
        }
        if (rows - r >= 2) {
            const float *x0 = x + r * ldx, *x1 = x0 + ldx;
            float s0 = 0.f, s1 = 0.f;
            #pragma omp simd reduction(+:s0, s1)
            for (int64_t k = 0; k < K; k++) { const float wk = LOAD(wn[k]); s0 += x0[k] * wk; s1 += x1[k] * wk; }
            out[r * ldo + n] = s0; out[(r + 1) * ldo + n] = s1;
            r += 2;
        }
        if (r < rows) {  /* one row: two independent sums over the two halves of the column */
            const float *x0 = x + r * ldx;
            float s0 = 0.f, s1 = 0.f;
            const int64_t half = (K / 32) * 16;
            #pragma omp simd reduction(+:s0, s1)
            for (int64_t k = 0; k < half; k++) { s0 += x0[k] * LOAD(wn[k]); s1 += x0[half + k] * LOAD(wn[half + k]); }
            for (int64_t k = 2 * half; k < K; k++) s0 += x0[k] * LOAD(wn[k]);
            out[r * ldo + n] = s0 + s1;
        }
    }
}
"""

_ENTRY = r"""
/* the most rows a group of this layout has in the kernel: float32 weights any (the blocked loop outruns sgemm at
   every row count measured), bfloat16 ones up to MAX_ROWS */
static inline int64_t kernel_rows(int wbf16, int64_t sn) { return wbf16 ? MAX_ROWS : INT32_MAX; }

/* the most rows an expert of the fused experts (float32) has for its rows to go with the other small experts' in one
   pass over every expert (their rows and sums held in memory side by side); an expert with more runs alone, its rows
   and sums in cache: the dense loop's WIDE_ROWS for `in` contiguous, MAX_ROWS for `out` contiguous */
static inline int64_t bulk_rows(int64_t sn) { return sn != 1 ? WIDE_ROWS : MAX_ROWS; }

/* out = x @ w per expert group, x (S, K) float32 rows sorted by expert, w (E, K, N) float32 or (wbf16) bfloat16 with
   strides (se, sk, sn), sk == 1 or sn == 1, out (S, N) float32. Computes the groups with 1..kernel_rows rows and
   zeroes the rows past the last group; returns how many groups have more rows (the caller computes those), or -1 if
   the layout is not one it takes, the offsets point past x or a buffer cannot be had. */
int64_t codegen_grouped_mm(const float *x, int64_t S, int64_t ldx, const void *w, int wbf16, int64_t se, int64_t sk,
                           int64_t sn, const void *offs, int offs64, int64_t E, int64_t K, int64_t N,
                           float *out, int64_t ldo, int threads) {
    if (sn != 1 && sk != 1) return -1;
    int64_t *small = (int64_t *)malloc((E > 0 ? E : 1) * sizeof(int64_t));
    if (!small) return -1;
    int64_t nsmall = 0, large = 0, last = 0, most = 1;
    const int64_t limit = kernel_rows(wbf16, sn);
    for (int64_t e = 0; e < E; e++) {
        int64_t start, end;
        group(offs, offs64, e, &start, &end);
        if (end > S || start < 0) { free(small); return -1; }  /* not offsets into x: left to the caller's torch */
        if (end - start > limit) large++;
        else if (end > start) { small[nsmall++] = e; if (end - start > most) most = end - start; }
        if (end > last) last = end;
    }
    for (int64_t r = last; r < S; r++) memset(out + r * ldo, 0, N * sizeof(float));
    /* columns per task: every column on one thread for float32 weights (a row-major weight streams in its memory
       order; the dense loop transposes a task's rows once per task), else whole panels of the blocked loop for
       row-major float32 weights (the streamed loop's sums are `out` itself), as many as the most rows' accumulators
       allow for bfloat16 ones, or a fixed share */
    const int blocked = sn == 1 && !wbf16;
    int64_t block = !wbf16 && threads == 1 ? N : blocked ? BLOCKED_COLUMNS
                  : sn == 1 ? (ACC_FLOATS / most) / 16 * 16 : 256;
    if (blocked && threads > 1 && nsmall * ((N + block - 1) / block) < 2 * threads) {
        /* too few tasks for the threads (an expert alone: a prefill's): a share of whole panels per thread */
        const int64_t width = BLOCKED_WIDTH;
        const int64_t share = ((N + threads - 1) / threads + width - 1) / width * width;
        if (share < block) block = share < 2 * width ? 2 * width : share;
    }
    if (block < MIN_BLOCK) block = MIN_BLOCK;
    const int64_t blocks = (N + block - 1) / block, tasks = nsmall * blocks;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1) reduction(|:failed)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t e = small[t / blocks], n0 = (t % blocks) * block;
        const int64_t nb = N - n0 < block ? N - n0 : block;
        int64_t start, end;
        group(offs, offs64, e, &start, &end);
        const float *xg = x + start * ldx;
        const int64_t at = e * se + n0 * sn, rows = end - start;
        float *og = out + start * ldo + n0;
        if (wbf16) {
            const uint16_t *we = (const uint16_t *)w + at;
            if (sn == 1) by_weight_rows_bf16(xg, ldx, we, sk, K, rows, nb, og, ldo);
            else by_weight_columns_bf16(xg, ldx, we, sn, K, rows, nb, og, ldo);
        } else {
            const float *we = (const float *)w + at;
            if (sn != 1) failed |= linear_rows_span(xg, rows, ldx, we, sn, K, 0, nb, NULL, og, ldo);
            else {
                const float *next = t + 1 < tasks && nb == N && K * sk * (int64_t)sizeof(float) <= PREFETCH_NEXT_BYTES
                                    ? (const float *)w + small[t / blocks + 1] * se : NULL;
                if (rows > STREAMED_ROWS) by_weight_rows_blocked(xg, ldx, we, sk, K, rows, nb, og, ldo, next);
                else by_weight_rows_streamed(xg, ldx, we, sk, K, rows, nb, og, ldo, next);
            }
        }
    }
    free(small);
    return failed ? -1 : large;
}
"""

_FUSED = r"""
/* the gates the fused experts apply to [gate, up] (codegen.policy.runtime.base GATE_*) */
#define GATE_SILU 0          /* silu(gate) * up, gate the first half of the row and up the second */
#define GATE_CLAMPED_SWIGLU 1 /* (min(max(up, -limit), limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
                                 gate and up interleaved (gate at even columns) */

/* 1 / (1 + e^-x) lane by lane, through e^-|x| (exp_lanes takes x <= 0): for x < 0 it is e^x / (1 + e^x) */
static inline lane_vector sigmoid_lanes(lane_vector x) {
    lane_ints bits;
    memcpy(&bits, &x, sizeof bits);
    bits |= INT32_MIN;  /* -|x| */
    lane_vector least;
    memcpy(&least, &bits, sizeof least);
    const lane_vector t = exp_lanes(least), r = 1.0f / (1.0f + t);
    return lanes_where(x < 0.0f, t * r, r);
}

/* h (rows x I2 / 2, ldh) = the gate of g (rows x I2, ldg), after adding `bias` (I2, or NULL) to every row of g:
   a vector of outputs at a time in vector registers (e^x by exp_lanes; expf one by one cost a tenth to a sixth of a
   prefill's expert time), the tail past the last whole vector one by one */
static void gate_rows(float *g, int64_t ldg, int64_t rows, int64_t I2, const float *bias, int gate, float alpha,
                      float limit, float *h, int64_t ldh, int threads) {
    const int64_t I = I2 / 2, whole = I / LANES * LANES;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *gr = g + r * ldg, *hr = h + r * ldh;
        if (bias)
            for (int64_t i = 0; i < I2; i++) gr[i] += bias[i];
        if (gate == GATE_SILU) {
            for (int64_t i = 0; i < whole; i += LANES) {
                const lane_vector gv = *(const lane_vector *)(gr + i), up = *(const lane_vector *)(gr + I + i);
                *(lane_vector *)(hr + i) = gv * sigmoid_lanes(gv) * up;
            }
            for (int64_t i = whole; i < I; i++) hr[i] = gr[i] / (1.f + expf(-gr[i])) * gr[I + i];
        } else {
            for (int64_t i = 0; i < whole; i += LANES) {
                const lane_vector lo = *(const lane_vector *)(gr + 2 * i), hi = *(const lane_vector *)(gr + 2 * i + LANES);
#if LANES == 16
                const lane_vector gate_in = SHUFFLE(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
                const lane_vector up_in = SHUFFLE(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
                const lane_vector gate_in = SHUFFLE(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
                const lane_vector up_in = SHUFFLE(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
                const lane_vector top = (lane_vector){0} + limit, bottom = (lane_vector){0} - limit;
                const lane_vector gv = lanes_where(gate_in < limit, gate_in, top);
                const lane_vector up = lanes_where(up_in < -limit, bottom, lanes_where(up_in > limit, top, up_in));
                *(lane_vector *)(hr + i) = (up + 1.f) * (gv * sigmoid_lanes(alpha * gv));
            }
            for (int64_t i = whole; i < I; i++) {
                const float gv = gr[2 * i] < limit ? gr[2 * i] : limit;
                const float up = gr[2 * i + 1] < -limit ? -limit : (gr[2 * i + 1] > limit ? limit : gr[2 * i + 1]);
                hr[i] = (up + 1.f) * (gv / (1.f + expf(-alpha * gv)));
            }
        }
    }
}

/* out[tok[r]] += wt[r] * (d[r] + bias) for the rows of one expert (bias: H, or NULL): each thread owns a run of
   columns, so no two threads write one element and every element adds its terms in the same order whatever the
   thread count */
static void add_weighted(float *out, int64_t H, const int64_t *tok, const float *wt, const float *d, int64_t rows,
                         const float *bias, int threads) {
    const int64_t chunk = 256, chunks = (H + chunk - 1) / chunk;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t h0 = c * chunk, h1 = h0 + chunk < H ? h0 + chunk : H;
        for (int64_t r = 0; r < rows; r++) {
            float *o = out + tok[r] * H;
            const float *dr = d + r * H;
            const float w = wt[r];
            if (bias) {
                #pragma omp simd
                for (int64_t h = h0; h < h1; h++) o[h] += w * (dr[h] + bias[h]);
            } else {
                #pragma omp simd
                for (int64_t h = h0; h < h1; h++) o[h] += w * dr[h];
            }
        }
    }
}

/* out (T, H) = for each token, over its k routed experts in expert order, the sum of weight * (down(gate(x @ w1 + b1))
   + b2), w1 (E, H, I2) and w2 (E, I2 / 2, H) float32 with element strides (expert, in, out), in or out 1; b1 (E, I2)
   and b2 (E, H) with expert strides sb1 and sb2 (NULL: none). Each expert's rows are gathered, multiplied, gated,
   multiplied and added into `out` while they are in cache. Experts with fewer than alone_rows (bulk_rows + 1) rows
   go first, all together, through codegen_grouped_mm; the others one by one, through it too. Measured, one thread,
   one MoE layer of a TP=2 shard at the bench's published widths, float32, against sgemm for every expert: 64 tokens
   (a batch-1 prefill, 4-8 rows per expert) 82-99 ms against 132-170 (Qwen1.5-MoE, DeepSeek-V2, Qwen3-MoE) and 200
   against 274 (GPT-OSS), 16 tokens 3-10% faster. The experts alone, in the kernel's loops instead of sgemm (random
   routing, 1024 tokens, AMD EPYC): 537 -> 508 ms (Qwen3-MoE), 457 -> 430 (Qwen1.5-MoE), 1162 -> 1026 (GPT-OSS).
   Returns 0, -1 for an expert id outside 0..E-1 or a layout it does not take, -2 when out of memory. */
int64_t codegen_fused_experts(const float *x, int64_t T, int64_t ldx, const int64_t *idx, const float *wts, int64_t k,
                              int64_t E, const float *w1, int64_t s1e, int64_t s1k, int64_t s1n, const float *w2,
                              int64_t s2e, int64_t s2k, int64_t s2n, int64_t H, int64_t I2, const float *b1,
                              int64_t sb1, const float *b2, int64_t sb2, int gate, float alpha, float limit,
                              float *out, int threads) {
    const int64_t r1 = bulk_rows(s1n), r2 = bulk_rows(s2n);
    const int64_t S = T * k, I = I2 / 2, alone_rows = (r1 < r2 ? r1 : r2) + 1;
    if (I2 % 2 || (s1k != 1 && s1n != 1)
        || (s2k != 1 && s2n != 1) || (gate != GATE_SILU && gate != GATE_CLAMPED_SWIGLU)) return -1;
    for (int64_t s = 0; s < S; s++) if (idx[s] < 0 || idx[s] >= E) return -1;
    int64_t *start = (int64_t *)calloc(E + 1, sizeof(int64_t)), *small_ends = (int64_t *)malloc(E * sizeof(int64_t));
    int64_t *tok = (int64_t *)malloc((S + 1) * sizeof(int64_t)), *fill = (int64_t *)malloc((E + 1) * sizeof(int64_t));
    float *wt = (float *)malloc((S + 1) * sizeof(float));
    float *buffer = NULL;
    int64_t status = -2;
    if (!start || !small_ends || !tok || !fill || !wt) goto done;
    /* each expert's rows, in token order: the token and its routing weight */
    for (int64_t s = 0; s < S; s++) start[idx[s] + 1]++;
    int64_t most = 0, small_rows = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = start[e + 1];
        if (rows >= alone_rows && rows > most) most = rows;
        if (rows < alone_rows) small_rows += rows;
        small_ends[e] = small_rows;
        start[e + 1] += start[e];
    }
    memcpy(fill, start, (E + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < S; s++) { const int64_t at = fill[idx[s]]++; tok[at] = s / k; wt[at] = wts[s]; }
    /* the small experts' rows side by side (xs, gs, hs, ds), then one large expert's at a time (xl, gl, hl, dl) */
    const int64_t row_floats = 2 * H + I2 + I;
    buffer = (float *)malloc(((small_rows + most) * row_floats + 1) * sizeof(float));
    if (!buffer) goto done;
    float *xs = buffer, *gs = xs + small_rows * H, *hs = gs + small_rows * I2, *ds = hs + small_rows * I;
    float *xl = ds + small_rows * H, *gl = xl + most * H, *hl = gl + most * I2, *dl = hl + most * I;
    for (int64_t t = 0; t < T; t++) memset(out + t * H, 0, H * sizeof(float));
    if (small_rows) {
        for (int64_t e = 0, r = 0; e < E; e++)
            if (start[e + 1] - start[e] < alone_rows)
                for (int64_t j = start[e]; j < start[e + 1]; j++, r++) memcpy(xs + r * H, x + tok[j] * ldx, H * sizeof(float));
        if (codegen_grouped_mm(xs, small_rows, H, w1, 0, s1e, s1k, s1n, small_ends, 1, E, H, I2, gs, I2, threads)) {
            status = -1;
            goto done;
        }
        if (b1) {
            for (int64_t e = 0; e < E; e++) {
                const int64_t rows = start[e + 1] - start[e];
                if (rows && rows < alone_rows)
                    gate_rows(gs + (small_ends[e] - rows) * I2, I2, rows, I2, b1 + e * sb1, gate, alpha, limit,
                              hs + (small_ends[e] - rows) * I, I, 1);
            }
        } else {
            gate_rows(gs, I2, small_rows, I2, NULL, gate, alpha, limit, hs, I, threads);
        }
        if (codegen_grouped_mm(hs, small_rows, I, w2, 0, s2e, s2k, s2n, small_ends, 1, E, I, H, ds, H, threads)) {
            status = -1;
            goto done;
        }
    }
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = start[e + 1] - start[e], *te = tok + start[e];
        const float *we = wt + start[e], *bias2 = b2 ? b2 + e * sb2 : NULL;
        if (rows == 0) continue;
        if (rows < alone_rows) {
            add_weighted(out, H, te, we, ds + (small_ends[e] - rows) * H, rows, bias2, threads);
            continue;
        }
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t r = 0; r < rows; r++) memcpy(xl + r * H, x + te[r] * ldx, H * sizeof(float));
        if (codegen_grouped_mm(xl, rows, H, w1 + e * s1e, 0, 0, s1k, s1n, &rows, 1, 1, H, I2, gl, I2, threads)) {
            status = -1;
            goto done;
        }
        gate_rows(gl, I2, rows, I2, b1 ? b1 + e * sb1 : NULL, gate, alpha, limit, hl, I, threads);
        if (codegen_grouped_mm(hl, rows, I, w2 + e * s2e, 0, 0, s2k, s2n, &rows, 1, 1, I, H, dl, H, threads)) {
            status = -1;
            goto done;
        }
        add_weighted(out, H, te, we, dl, rows, bias2, threads);
    }
    status = 0;
done:
    free(start); free(small_ends); free(tok); free(fill); free(wt); free(buffer);
    return status;
}
"""


_LINEAR = r"""
/* Rows by a dense weight: out (R x N) = x (R x K) @ w^T (+ bias), w (N x K) float32 with K contiguous (an nn.Linear's
   weight, or its DeepSpeed shard), R at most MAX_ROWS (a decode step's tokens). torch's BLAS runs such products at a
   third of the machine's read bandwidth; here a tile of 4 rows by 6 weight rows keeps 24 sums in vector registers,
   each weight vector loaded once for 4 rows; K goes in chunks whose rows of x stay in L1 while the weight streams
   through them once, and the next block's weight rows are fetched into L2 while this one is summed. */
/* The vector and the tiles' shapes, by the registers the CPU has: with AVX-512 a vector is 16 floats and a tile
   holds up to 24 of the 32 registers; elsewhere (AVX2's 16 registers of 8 floats; NEON's 32 of 4 hold as many) a
   vector is 8 floats and a tile half as many sums. The 16-float vector on AVX2 became two registers each, its tiles
   spilled their sums to the stack at every multiply-add and its shuffles went element by element: measured on an
   AMD EPYC (AVX2), one thread, 128 rows by a 256 x 512 weight 6.3 ms against torch's 0.50, a 2048-token prefill's
   fused experts at toy Qwen3-MoE widths 1345 ms against 93 for torch's matmul per expert (the narrower shapes
   below measured no slower than the others tried: streamed depth 8, blocked 4 x 3, dense blocks of 4 and 6). */
#if defined(__AVX512F__)
#define LANES 16
#define LINEAR_BLOCK 6     /* weight rows per tile of the dense loop (4 rows by 6: 24 sums) */
#define LANES_PANEL 8      /* weight rows per panel where the rows are one vector's lanes */
#define WIDE_SUMS 24       /* the sums of a panel where the rows are several vectors' lanes */
#define BLOCKED_ROWS 8     /* the blocked loop's tile: 8 rows by 3 vectors of columns (24 sums) */
#define BLOCKED_VECTORS 3
#define STREAMED_DEPTH 8   /* weight rows per pass of the streamed loop */
#define ATTENTION_SUMS 16  /* the decode attention's sums of values in registers */
#else
#define LANES 8
#define LINEAR_BLOCK 3     /* 4 rows by 3: 12 sums */
#define LANES_PANEL 6
#define WIDE_SUMS 12
#define BLOCKED_ROWS 6     /* 6 rows by 2 vectors: 12 sums */
#define BLOCKED_VECTORS 2
#define STREAMED_DEPTH 4
#define ATTENTION_SUMS 8
#endif
typedef float lane_vector __attribute__((vector_size(LANES * 4), aligned(4)));  /* loaded unaligned */
#define VECTOR_BYTES ((int64_t)sizeof(lane_vector))
/* a prompt's rows as the lanes of at most 4 vectors (LANES_WIDE below) */
#if WIDE_ROWS > 4 * LANES
#undef WIDE_ROWS
#define WIDE_ROWS (4 * LANES)
#endif
#define LINEAR_X_FLOATS 8192  /* x's rows per pass: 32 KiB */
#if MAX_ROWS * LINEAR_BLOCK % LANES
#error "the sums of MAX_ROWS rows of a block must fill whole vectors (lanes_summed)"
#endif

#define SHUFFLE __builtin_shufflevector  /* GCC 12+ and clang */

/* lane m of the result = the sum of v[m]'s lanes, for LANES vectors at once: a round of pairwise shuffles and adds
   per bit of the lane index (16 lanes: 4 rounds, 15 vector adds) where summing each vector's lanes one by one takes
   LANES dependent scalar adds per vector, which cost as much as the tile's own multiply-adds when K is 256-512 */
#if LANES == 16
static inline lane_vector lanes_summed(const lane_vector *v) {
    lane_vector t[8], u[4], h[2];
    for (int i = 0; i < 8; i++)  /* lanes 0-7: v[2i]'s partial sums, 8-15: v[2i + 1]'s */
        t[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* 4 lanes for each of v[4i .. 4i + 3] */
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* 2 lanes for each of v[8i .. 8i + 7] */
        h[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(h[0], h[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE(h[0], h[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
static inline lane_vector lanes_summed(const lane_vector *v) {  /* the same for 8 vectors: three rounds */
    lane_vector u[4], h[2];
    for (int i = 0; i < 4; i++)  /* lanes 0-3: v[2i]'s partial sums, 4-7: v[2i + 1]'s */
        u[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUFFLE(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)  /* 2 lanes for each of v[4i .. 4i + 3] */
        h[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + SHUFFLE(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE(h[0], h[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(h[0], h[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* sums[i * stride + j] += x row i (of RT) . w row j (of NT) over k0..k1 (multiples of LANES), starting from 0 where
   k0 is 0 (the first pass: nothing to zero beforehand); `ahead`: the distance to the next block's weight rows,
   fetched into L2 on the way (0: none) */
#define LINEAR_TILE(NAME, RT, NT)                                                                                \
static void NAME(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t k0, int64_t k1,             \
                 lane_vector *sums, int64_t stride, int64_t ahead) {                                             \
    lane_vector a[RT][NT];                                                                                       \
    for (int i = 0; i < RT; i++)                                                                                 \
        for (int j = 0; j < NT; j++) a[i][j] = k0 ? sums[i * stride + j] : (lane_vector){0};                   \
    for (int64_t k = k0; k < k1; k += LANES) {                                                                  \
        lane_vector wv[NT];                                                                                      \
        for (int j = 0; j < NT; j++) wv[j] = *(const lane_vector *)(w + j * ldw + k);                           \
        if (ahead) for (int j = 0; j < NT; j++) __builtin_prefetch(w + ahead + j * ldw + k, 0, 2);             \
        for (int i = 0; i < RT; i++) {                                                                           \
            const lane_vector xv = *(const lane_vector *)(x + i * ldx + k);                                     \
            for (int j = 0; j < NT; j++) a[i][j] += xv * wv[j];                                                  \
        }                                                                                                        \
    }                                                                                                            \
    for (int i = 0; i < RT; i++) for (int j = 0; j < NT; j++) sums[i * stride + j] = a[i][j];                   \
}
LINEAR_TILE(linear_full_4, 4, LINEAR_BLOCK) LINEAR_TILE(linear_full_3, 3, LINEAR_BLOCK)
LINEAR_TILE(linear_full_2, 2, LINEAR_BLOCK) LINEAR_TILE(linear_full_1, 1, LINEAR_BLOCK)
LINEAR_TILE(linear_one_4, 4, 1) LINEAR_TILE(linear_one_3, 3, 1) LINEAR_TILE(linear_one_2, 2, 1)
LINEAR_TILE(linear_one_1, 1, 1)

typedef void (*linear_tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, lane_vector *,
                               int64_t, int64_t);
static const linear_tile_fn LINEAR_FULL[5] = {0, linear_full_1, linear_full_2, linear_full_3, linear_full_4};
static const linear_tile_fn LINEAR_ONE[5] = {0, linear_one_1, linear_one_2, linear_one_3, linear_one_4};

/* Rows by a row-major float32 weight (w[k * sk + n], input dim first: the experts as the fused experts store them),
   more than STREAMED_ROWS: a tile of 8 rows by 3 vectors of columns keeps 24 sums in registers, each weight vector
   loaded once for 8 rows and each x value broadcast once for 3 vectors. K goes in blocks of BLOCKED_KC: a tile's
   sums stay in registers over a whole block (they live in `out` between blocks), a block's panel of the weight
   (BLOCKED_KC x 48 columns, 48 KiB) serves every row tile from L2, and the first row tile fetches the next panel on
   its way. Measured on the AMD EPYC (AVX-512), one thread, 4 experts' groups by a 2048 x 768 weight, 16 / 64 / 256
   rows: 99 / 105 / 108 GFLOP/s, where torch's matmul (sgemm) ran 50 / 80 / 97; 8 experts of 4-16 rows, four shapes:
   35-99 where the loop before this one (4 rows by 6 vectors, its sums in `out` every 16 weight rows) ran 23-53. */
#define BLOCKED_KC 256
#define BLOCKED_WIDTH (LANES * BLOCKED_VECTORS)  /* a tile's (and a panel's) columns */
/* a task's columns by a row-major float32 weight when threads share the experts (on one thread a task holds every
   column): a multiple of the tile's width */
#define BLOCKED_COLUMNS (28 * BLOCKED_WIDTH)

/* sums (RT x NV vectors, lds apart) = (first ? 0 : sums) + x (RT rows, ldx) @ w (kc rows, sk apart) */
#define BLOCKED_TILE(NAME, RT, NV)                                                                               \
static void NAME(const float *x, int64_t ldx, const float *w, int64_t sk, int64_t kc, float *sums, int64_t lds,  \
                 int first, const char *pf, int64_t pstep) {                                                     \
    lane_vector a[RT][NV];                                                                                       \
    for (int i = 0; i < RT; i++)                                                                                 \
        for (int j = 0; j < NV; j++)                                                                             \
            a[i][j] = first ? (lane_vector){0} : *(lane_vector *)(sums + i * lds + LANES * j);                  \
    for (int64_t k = 0; k < kc; k++) {                                                                           \
        lane_vector wv[NV];                                                                                      \
        for (int j = 0; j < NV; j++) wv[j] = *(const lane_vector *)(w + k * sk + LANES * j);                    \
        if (pf) for (int j = 0; j < NV; j++) __builtin_prefetch(pf + k * pstep + VECTOR_BYTES * j, 0, 2);       \
        for (int i = 0; i < RT; i++) {                                                                           \
            const float xs = x[i * ldx + k];                                                                     \
            for (int j = 0; j < NV; j++) a[i][j] += xs * wv[j];                                                  \
        }                                                                                                        \
    }                                                                                                            \
    for (int i = 0; i < RT; i++)                                                                                 \
        for (int j = 0; j < NV; j++) *(lane_vector *)(sums + i * lds + LANES * j) = a[i][j];                    \
}
#if BLOCKED_ROWS > 8
#error "BLOCKED_ROWS: at most 8"
#endif
BLOCKED_TILE(blocked_full_1, 1, BLOCKED_VECTORS) BLOCKED_TILE(blocked_full_2, 2, BLOCKED_VECTORS)
BLOCKED_TILE(blocked_full_3, 3, BLOCKED_VECTORS) BLOCKED_TILE(blocked_full_4, 4, BLOCKED_VECTORS)
BLOCKED_TILE(blocked_full_5, 5, BLOCKED_VECTORS) BLOCKED_TILE(blocked_full_6, 6, BLOCKED_VECTORS)
BLOCKED_TILE(blocked_full_7, 7, BLOCKED_VECTORS) BLOCKED_TILE(blocked_full_8, 8, BLOCKED_VECTORS)
BLOCKED_TILE(blocked_one_1, 1, 1) BLOCKED_TILE(blocked_one_2, 2, 1) BLOCKED_TILE(blocked_one_3, 3, 1)
BLOCKED_TILE(blocked_one_4, 4, 1) BLOCKED_TILE(blocked_one_5, 5, 1) BLOCKED_TILE(blocked_one_6, 6, 1)
BLOCKED_TILE(blocked_one_7, 7, 1) BLOCKED_TILE(blocked_one_8, 8, 1)

typedef void (*blocked_tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int,
                                const char *, int64_t);
static const blocked_tile_fn BLOCKED_FULL[9] = {
    0, blocked_full_1, blocked_full_2, blocked_full_3, blocked_full_4, blocked_full_5, blocked_full_6, blocked_full_7,
    blocked_full_8};
static const blocked_tile_fn BLOCKED_ONE[9] = {
    0, blocked_one_1, blocked_one_2, blocked_one_3, blocked_one_4, blocked_one_5, blocked_one_6, blocked_one_7,
    blocked_one_8};

/* every row tile of one panel (the tiles of `tile`) over one block of kc inputs; the first tile fetches a line per
   vector each input on its way, from pf on, pstep bytes apart (pf NULL: none) */
static void panel_rows(const blocked_tile_fn *tile, const float *x, int64_t ldx, const float *w, int64_t sk,
                       int64_t kc, int64_t rows, float *out, int64_t ldo, int first, const char *pf, int64_t pstep) {
    for (int64_t r = 0; r < rows; r += BLOCKED_ROWS) {
        const int64_t rt = rows - r < BLOCKED_ROWS ? rows - r : BLOCKED_ROWS;
        tile[rt](x + r * ldx, ldx, w, sk, kc, out + r * ldo, ldo, first, r == 0 ? pf : NULL, pstep);
    }
}

/* columns n0..n1 (those past the last whole vector) over one block of kc inputs, one by one: w[k * sk + n * sn] */
static void tail_columns(const float *x, int64_t ldx, const float *w, int64_t sk, int64_t sn, int64_t kc,
                         int64_t rows, int64_t n0, int64_t n1, float *out, int64_t ldo, int first) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = n0; n < n1; n++) {
            float s = first ? 0.f : out[r * ldo + n];
            for (int64_t k = 0; k < kc; k++) s += x[r * ldx + k] * w[k * sk + n * sn];
            out[r * ldo + n] = s;
        }
}

static void by_weight_rows_blocked(const float *x, int64_t ldx, const float *w, int64_t sk, int64_t K, int64_t rows,
                                   int64_t nb, float *out, int64_t ldo, const float *next) {
    const int64_t width = BLOCKED_WIDTH, wide = nb / width * width, lanes = nb / LANES * LANES;
    const char *stream = (const char *)next;  /* the next expert's weight, in its memory order (NULL: none) */
    for (int64_t k0 = 0; k0 < K; k0 += BLOCKED_KC) {
        const int64_t kc = K - k0 < BLOCKED_KC ? K - k0 : BLOCKED_KC;
        const int first = k0 == 0;
        const float *xk = x + k0, *wk = w + k0 * sk;
        for (int64_t n0 = 0; n0 < wide; n0 += width) {
            /* the next expert's lines in order, else the next panel of this weight, a row at a time */
            const char *ahead = stream ? stream : n0 + width < nb ? (const char *)(wk + n0 + width) : NULL;
            panel_rows(BLOCKED_FULL, xk, ldx, wk + n0, sk, kc, rows, out + n0, ldo, first, ahead,
                       stream ? VECTOR_BYTES * BLOCKED_VECTORS : sk * (int64_t)sizeof(float));
            if (stream) stream += kc * VECTOR_BYTES * BLOCKED_VECTORS;
        }
        for (int64_t n0 = wide; n0 < lanes; n0 += LANES) {
            panel_rows(BLOCKED_ONE, xk, ldx, wk + n0, sk, kc, rows, out + n0, ldo, first, stream, VECTOR_BYTES);
            if (stream) stream += kc * VECTOR_BYTES;
        }
        tail_columns(xk, ldx, wk, sk, 1, kc, rows, lanes, nb, out, ldo, first);
    }
}

/* Up to STREAMED_ROWS rows (a decode step's experts) by a row-major float32 weight: STREAMED_DEPTH weight rows at a
   time, their columns in one pass, each weight vector loaded once for every row and added into the rows' sums in
   `out` (in L1 or L2); the weight rows STREAMED_AHEAD rows on are fetched into L2 on the way, which the hardware's
   own prefetch does not keep up with here (or, given `next`, the next expert's weight: PREFETCH_NEXT_BYTES). Eight
   weight rows a pass, over every column of the weight (a task of one thread's), where it was four over strips of
   BLOCKED_COLUMNS: the sums are read and written half as often, and the weight streams in its memory order instead
   of strips of rows 5-11 KiB apart (a strip of 64 columns read 256 bytes of each row). Measured on the AMD EPYC
   (AVX-512), one thread, weights from memory in huge pages, one layer's hit experts at TP=2 widths, one row each:
   gpt-oss-20b 19.3 -> 22.5 GB/s, Qwen3-MoE 17.6 -> 19.7, Qwen1.5-MoE 18.4 -> 20.9 (torch's sum of the same weights:
   25-26); the loop alone on a 2880 x 2880 weight, 1 / 4 rows: 17.1 / 13.0 -> 24.5 / 19.0 GB/s. */
#define STREAMED_ROWS 4
#define STREAMED_AHEAD 16
static void by_weight_rows_streamed(const float *x, int64_t ldx, const float *w, int64_t sk, int64_t K,
                                    int64_t rows, int64_t nb, float *out, int64_t ldo, const float *next) {
    const int64_t lanes = nb / LANES * LANES, ahead = STREAMED_AHEAD * sk;
    const char *stream = (const char *)next;  /* the next expert's weight, in its memory order (NULL: none) */
    for (int64_t r = 0; r < rows; r++) memset(out + r * ldo, 0, nb * sizeof(float));
    int64_t k = 0;
    for (; k + STREAMED_DEPTH <= K; k += STREAMED_DEPTH) {
        const float *wk = w + k * sk;
        const int fetch = !stream && k + STREAMED_AHEAD + STREAMED_DEPTH <= K;
        lane_vector xb[STREAMED_ROWS][STREAMED_DEPTH];
        for (int64_t r = 0; r < rows; r++)
            for (int i = 0; i < STREAMED_DEPTH; i++) xb[r][i] = (lane_vector){0} + x[r * ldx + k + i];
        for (int64_t n = 0; n < lanes; n += LANES) {
            lane_vector v[STREAMED_DEPTH];
            for (int i = 0; i < STREAMED_DEPTH; i++) v[i] = *(const lane_vector *)(wk + i * sk + n);
            /* the next expert's lines in order, else this weight's rows STREAMED_AHEAD on */
            const char *pf = stream ? stream : fetch ? (const char *)(wk + ahead + n) : NULL;
            const int64_t pstep = stream ? VECTOR_BYTES : sk * (int64_t)sizeof(float);
            if (pf)
                for (int i = 0; i < STREAMED_DEPTH; i++) __builtin_prefetch(pf + i * pstep, 0, 2);
            if (stream) stream += VECTOR_BYTES * STREAMED_DEPTH;
            for (int64_t r = 0; r < rows; r++) {
                lane_vector *o = (lane_vector *)(out + r * ldo + n);
                lane_vector sum = *o;
                for (int i = 0; i < STREAMED_DEPTH; i++) sum += xb[r][i] * v[i];
                *o = sum;
            }
        }
        for (int64_t n = lanes; n < nb; n++)  /* the columns past the last whole vector */
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * ldx + k;
                float sum = out[r * ldo + n];
                for (int i = 0; i < STREAMED_DEPTH; i++) sum += xr[i] * wk[i * sk + n];
                out[r * ldo + n] = sum;
            }
    }
    for (; k < K; k++)  /* K's tail past the last whole pass */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t n = 0; n < nb; n++) out[r * ldo + n] += x[r * ldx + k] * w[k * sk + n];
}

/* out (R x n1 - n0, ldo) = x (R x K, ldx) @ (w's rows n0..n1)^T + bias[n0..n1] (or none), w (N x K, ldw), one
   thread: block after block of LINEAR_BLOCK weight rows, the next block fetched while one is summed */
static void linear_span(const float *x, int64_t R, int64_t ldx, const float *w, int64_t ldw, int64_t K, int64_t n0,
                        int64_t n1, const float *bias, float *out, int64_t ldo) {
    const int64_t whole = K / LANES * LANES;
    /* K per pass: the rows' chunk of x stays in L1 while a block's weight rows stream through it once */
    const int64_t chunk = LINEAR_X_FLOATS / R / LANES * LANES;
    for (int64_t b0 = n0; b0 < n1; b0 += LINEAR_BLOCK) {
        const int64_t nt = n1 - b0 < LINEAR_BLOCK ? n1 - b0 : LINEAR_BLOCK;
        const int64_t ahead = b0 + LINEAR_BLOCK < n1 ? LINEAR_BLOCK * ldw : 0;
        const float *wb = w + b0 * ldw;
        lane_vector sums[MAX_ROWS * LINEAR_BLOCK];
        const int64_t used = R * LINEAR_BLOCK, padded = (used + LANES - 1) / LANES * LANES;
        memset(sums + used, 0, (padded - used) * sizeof(lane_vector));  /* lanes_summed reads whole groups */
        if (whole == 0 || nt < LINEAR_BLOCK) memset(sums, 0, used * sizeof(lane_vector));  /* no tile zeroes them */
        for (int64_t k0 = 0; k0 < whole; k0 += chunk) {
            const int64_t k1 = k0 + chunk < whole ? k0 + chunk : whole;
            for (int64_t r = 0; r < R; r += 4) {
                const int64_t rt = R - r < 4 ? R - r : 4;
                const int64_t fetch = r == 0 ? ahead : 0;
                lane_vector *at = sums + r * LINEAR_BLOCK;
                if (nt == LINEAR_BLOCK)
                    LINEAR_FULL[rt](x + r * ldx, ldx, wb, ldw, k0, k1, at, LINEAR_BLOCK, fetch);
                else
                    for (int64_t j = 0; j < nt; j++)
                        LINEAR_ONE[rt](x + r * ldx, ldx, wb + j * ldw, ldw, k0, k1, at + j, LINEAR_BLOCK, 0);
            }
        }
        float summed[MAX_ROWS * LINEAR_BLOCK] __attribute__((aligned(64)));
        for (int64_t m = 0; m < R * LINEAR_BLOCK; m += LANES)  /* sums beyond R rows are zeros */
            *(lane_vector *)(summed + m) = lanes_summed(sums + m);
        if (whole < K)  /* K's tail past the last whole vector */
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < nt; j++) {
                    const float *xr = x + r * ldx, *wj = wb + j * ldw;
                    for (int64_t k = whole; k < K; k++) summed[r * LINEAR_BLOCK + j] += xr[k] * wj[k];
                }
        /* the block's outputs in one branch-free pass (per output, the tail loop's setup and the bias test cost 15%
           of a 16-row product at 512 inputs) */
        float add[LINEAR_BLOCK] = {0};
        if (bias)
            for (int64_t j = 0; j < nt; j++) add[j] = bias[b0 + j];
        if (nt == LINEAR_BLOCK)
            for (int64_t r = 0; r < R; r++)
                for (int j = 0; j < LINEAR_BLOCK; j++)
                    out[r * ldo + b0 - n0 + j] = summed[r * LINEAR_BLOCK + j] + add[j];
        else
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < nt; j++) out[r * ldo + b0 - n0 + j] = summed[r * LINEAR_BLOCK + j] + add[j];
    }
}

/* More than LANES / 2 rows: the rows are one vector's lanes (x transposed, K x LANES, the lanes past R zero), each
   weight element broadcast onto them and multiplied in, LANES_PANEL weight rows at a time, each read once from memory
   in its own order. The 4 x 6 tile above reloads x's rows from L2 for every 6 weight rows and stalls the weight's
   stream while it does (16 rows of a weight streamed from memory: 70 GFLOP/s, 8.7 GB/s); here x is one vector per k
   (92 GFLOP/s, 11.5 GB/s, about the read bandwidth of a single row's product). Up to LANES / 2 rows the tile stays:
   the lanes would be half empty. */
static void lanes_panel(const float *xt, const float *w, int64_t ldw, int64_t K, int64_t rows, lane_vector *acc,
                        int64_t ahead) {
    lane_vector a[LANES_PANEL];
    const float *p[LANES_PANEL];  /* a last panel's missing rows repeat its first: every output sums in one order */
    for (int j = 0; j < LANES_PANEL; j++) { a[j] = (lane_vector){0}; p[j] = w + (j < rows ? j : 0) * ldw; }
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {  /* one cache line of each weight row per pass, summed apart, then added */
        if (ahead)
            for (int j = 0; j < LANES_PANEL; j++) __builtin_prefetch(p[j] + ahead + k, 0, 2);
        const float *xk = xt + k * LANES;
        lane_vector line[LANES_PANEL];
        #pragma GCC unroll 8
        for (int j = 0; j < LANES_PANEL; j++) line[j] = p[j][k] * *(const lane_vector *)xk;
        #pragma GCC unroll 16
        for (int kk = 1; kk < LANES; kk++) {
            const lane_vector xv = *(const lane_vector *)(xk + kk * LANES);
            #pragma GCC unroll 8
            for (int j = 0; j < LANES_PANEL; j++) line[j] += p[j][k + kk] * xv;
        }
        #pragma GCC unroll 8
        for (int j = 0; j < LANES_PANEL; j++) a[j] += line[j];
    }
    for (; k < K; k++) {  /* K's tail past the last whole line */
        const lane_vector xv = *(const lane_vector *)(xt + k * LANES);
        for (int j = 0; j < LANES_PANEL; j++) a[j] += p[j][k] * xv;
    }
    for (int j = 0; j < rows; j++) acc[j] = a[j];
}

/* v[i][m] becomes v[m][i] (LANES x LANES): a round of pairwise shuffles per bit of the lane index, each swapping
   that bit of the row index with the same bit of the lane index */
#if LANES == 16
static inline void transposed_lanes(lane_vector *v) {
    for (int i = 0; i < LANES; i++) if (!(i & 1)) {
        const lane_vector a = v[i], c = v[i + 1];
        v[i] = SHUFFLE(a, c, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        v[i + 1] = SHUFFLE(a, c, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    for (int i = 0; i < LANES; i++) if (!(i & 2)) {
        const lane_vector a = v[i], c = v[i + 2];
        v[i] = SHUFFLE(a, c, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        v[i + 2] = SHUFFLE(a, c, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int i = 0; i < LANES; i++) if (!(i & 4)) {
        const lane_vector a = v[i], c = v[i + 4];
        v[i] = SHUFFLE(a, c, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        v[i + 4] = SHUFFLE(a, c, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < LANES; i++) if (!(i & 8)) {
        const lane_vector a = v[i], c = v[i + 8];
        v[i] = SHUFFLE(a, c, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        v[i + 8] = SHUFFLE(a, c, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
}
#else
static inline void transposed_lanes(lane_vector *v) {
    for (int i = 0; i < LANES; i++) if (!(i & 1)) {
        const lane_vector a = v[i], c = v[i + 1];
        v[i] = SHUFFLE(a, c, 0, 8, 2, 10, 4, 12, 6, 14);
        v[i + 1] = SHUFFLE(a, c, 1, 9, 3, 11, 5, 13, 7, 15);
    }
    for (int i = 0; i < LANES; i++) if (!(i & 2)) {
        const lane_vector a = v[i], c = v[i + 2];
        v[i] = SHUFFLE(a, c, 0, 1, 8, 9, 4, 5, 12, 13);
        v[i + 2] = SHUFFLE(a, c, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < LANES; i++) if (!(i & 4)) {
        const lane_vector a = v[i], c = v[i + 4];
        v[i] = SHUFFLE(a, c, 0, 1, 2, 3, 8, 9, 10, 11);
        v[i + 4] = SHUFFLE(a, c, 4, 5, 6, 7, 12, 13, 14, 15);
    }
}
#endif

static void linear_lanes_span(const float *xt, int64_t R, const float *w, int64_t ldw, int64_t K, int64_t n0,
                              int64_t n1, const float *bias, float *out, int64_t ldo) {
    for (int64_t p0 = n0; p0 < n1; p0 += LANES_PANEL) {
        const int64_t rows = n1 - p0 < LANES_PANEL ? n1 - p0 : LANES_PANEL;
        const int64_t ahead = p0 + 2 * LANES_PANEL <= n1 ? LANES_PANEL * ldw : 0;  /* the next panel, on the way */
        lane_vector acc[LANES_PANEL];
        lanes_panel(xt, w + p0 * ldw, ldw, K, rows, acc, ahead);
        for (int64_t j = 0; j < rows; j++) {
            const float add = bias ? bias[p0 + j] : 0.f;
            for (int64_t r = 0; r < R; r++) out[r * ldo + p0 - n0 + j] = acc[j][r] + add;
        }
    }
}

/* From LANES + 1 to WIDE_ROWS rows (a short prompt's prefill): the rows are the lanes of V = ceil(R / LANES)
   vectors, WIDE_SUMS / V weight rows at a time, their sums (WIDE_SUMS vectors) in registers over the whole K and
   each weight element broadcast onto V vectors of x. Past 16 rows a product is bound by its multiply-adds, not the
   weight's stream; torch's BLAS packs the weight on every call (from memory, not overlapped with its sums) and ran
   the 64-row products of a full-width Qwen1.5-MoE layer at 92-99 GFLOP/s, one thread (the GEMM rate: 150-165).
   Summing each line of 16 inputs apart and adding it to sums held in memory, as this loop did before, cost a fifth:
   AMD EPYC (AVX-512), one thread, a full-width Qwen1.5-MoE layer's dense weights from memory in huge pages, 32 / 64
   rows 78-79 / 89-90 -> 96 / 109-110 GFLOP/s; 20 experts of a 2048 x 1408 shard, 24 / 32 / 48 / 64 rows 57 / 75 /
   88 / 88 -> 69 / 91 / 107 / 103. */
#if WIDE_ROWS < MAX_ROWS
#error "WIDE_ROWS: at least MAX_ROWS"
#endif
#define LANES_WIDE(V)                                                                                            \
static void lanes_wide_##V(const float *xt, const float *w, int64_t ldw, int64_t K, int64_t rows,              \
                           lane_vector *acc, int64_t ahead) {                                                    \
    enum { P = WIDE_SUMS / V };                                                                                  \
    const float *p[P];  /* a last panel's missing rows repeat its first, as lanes_panel's do */                 \
    for (int j = 0; j < P; j++) p[j] = w + (j < rows ? j : 0) * ldw;                                            \
    lane_vector a[P][V];                                                                                         \
    for (int j = 0; j < P; j++) for (int v = 0; v < V; v++) a[j][v] = (lane_vector){0};                         \
    int64_t k = 0;                                                                                               \
    for (; k + LANES <= K; k += LANES) {                                                                         \
        if (ahead)                                                                                               \
            for (int j = 0; j < P; j++) __builtin_prefetch(p[j] + ahead + k, 0, 2);                             \
        const lane_vector *xk = (const lane_vector *)(xt + k * LANES * V);                                      \
        _Pragma("GCC unroll 16")                                                                                 \
        for (int kk = 0; kk < LANES; kk++) {                                                                     \
            _Pragma("GCC unroll 12")                                                                             \
            for (int j = 0; j < P; j++)                                                                          \
                for (int v = 0; v < V; v++) a[j][v] += p[j][k + kk] * xk[kk * V + v];                           \
        }                                                                                                        \
    }                                                                                                            \
    for (; k < K; k++) {  /* K's tail past the last whole line */                                               \
        const lane_vector *xk = (const lane_vector *)(xt + k * LANES * V);                                      \
        for (int j = 0; j < P; j++)                                                                              \
            for (int v = 0; v < V; v++) a[j][v] += p[j][k] * xk[v];                                              \
    }                                                                                                            \
    for (int j = 0; j < P; j++) for (int v = 0; v < V; v++) acc[j * V + v] = a[j][v];                           \
}
LANES_WIDE(2) LANES_WIDE(3) LANES_WIDE(4)

typedef void (*lanes_wide_fn)(const float *, const float *, int64_t, int64_t, int64_t, lane_vector *, int64_t);
static const lanes_wide_fn LANES_WIDE_BY_VECTORS[5] = {0, 0, lanes_wide_2, lanes_wide_3, lanes_wide_4};

/* a thread's buffer of at least `floats` floats, 64-byte aligned, kept between calls (slot: which of its buffers);
   NULL where it cannot grow. A fresh one per call (128 KiB and more) would be mapped and faulted in each time. */
static float *thread_buffer(int slot, int64_t floats) {
    static __thread float *held[2] = {NULL, NULL};
    static __thread int64_t held_floats[2] = {0, 0};
    if (held_floats[slot] < floats + 16) {
        float *grown = (float *)realloc(held[slot], (floats + 16) * sizeof(float));
        if (!grown) return NULL;
        held[slot] = grown;
        held_floats[slot] = floats + 16;
    }
    return (float *)(((uintptr_t)held[slot] + 63) & ~(uintptr_t)63);
}

/* the panels' sums go to a buffer column after column (V vectors each), then out row after row, 16 columns at a
   time transposed in registers (written one by one, the sums cost as much as a 128-input product's multiply-adds) */
static int linear_wide_span(const float *xt, int64_t R, const float *w, int64_t ldw, int64_t K, int64_t n0,
                            int64_t n1, const float *bias, float *out, int64_t ldo) {
    const int64_t V = (R + LANES - 1) / LANES, P = WIDE_SUMS / V, columns = n1 - n0;
    lane_vector *sums = (lane_vector *)thread_buffer(1, (columns + WIDE_SUMS + LANES) * V * LANES);
    if (!sums) return -1;
    for (int64_t p0 = n0; p0 < n1; p0 += P) {
        const int64_t rows = n1 - p0 < P ? n1 - p0 : P;
        const int64_t ahead = p0 + 2 * P <= n1 ? P * ldw : 0;  /* the next panel, on the way */
        LANES_WIDE_BY_VECTORS[V](xt, w + p0 * ldw, ldw, K, rows, sums + (p0 - n0) * V, ahead);
    }
    for (int64_t c0 = 0; c0 < columns; c0 += LANES) {
        const int64_t here = columns - c0 < LANES ? columns - c0 : LANES;
        lane_vector add = (lane_vector){0};
        if (bias) memcpy(&add, bias + n0 + c0, here * sizeof(float));
        for (int64_t v0 = 0; v0 < V; v0++) {
            lane_vector t[LANES];
            for (int64_t i = 0; i < LANES; i++) t[i] = i < here ? sums[(c0 + i) * V + v0] : (lane_vector){0};
            transposed_lanes(t);
            for (int64_t m = 0; m < LANES && v0 * LANES + m < R; m++) {
                const lane_vector o = t[m] + add;
                float *row = out + (v0 * LANES + m) * ldo + c0;
                if (here == LANES) *(lane_vector *)row = o;
                else memcpy(row, &o, here * sizeof(float));
            }
        }
    }
    return 0;
}

/* x (R x K, ldx) transposed into this thread's buffer: for each k, V = ceil(R / LANES) vectors, row r lane r % LANES
   of vector r / LANES, the lanes past R zero; NULL where the buffer cannot grow */
static float *transposed_rows(const float *x, int64_t R, int64_t ldx, int64_t K) {
    const int64_t V = (R + LANES - 1) / LANES;
    float *xt = thread_buffer(0, K * LANES * V);
    if (!xt) return NULL;
    const int64_t whole = K / LANES * LANES;
    for (int64_t v0 = 0; v0 < V; v0++) {
        const float *xv = x + v0 * LANES * ldx;
        const int64_t here = R - v0 * LANES < LANES ? R - v0 * LANES : LANES;
        for (int64_t k0 = 0; k0 < whole; k0 += LANES) {  /* LANES x LANES at a time, in registers */
            lane_vector v[LANES];
            for (int64_t r = 0; r < LANES; r++)
                v[r] = r < here ? *(const lane_vector *)(xv + r * ldx + k0) : (lane_vector){0};
            transposed_lanes(v);
            for (int64_t k = 0; k < LANES; k++) *(lane_vector *)(xt + ((k0 + k) * V + v0) * LANES) = v[k];
        }
        for (int64_t k = whole; k < K; k++)
            for (int64_t r = 0; r < LANES; r++) xt[(k * V + v0) * LANES + r] = r < here ? xv[r * ldx + k] : 0.f;
    }
    return xt;
}

/* rows by a dense weight's rows n0..n1: the tile up to LANES / 2 rows, one vector's lanes to LANES (the tile where
   x's transposition cannot be had), several vectors' lanes above, and past WIDE_ROWS rows chunks of whole vectors'
   rows, at most WIDE_ROWS each and as even as they go (each more than LANES rows: every output past LANES rows sums
   in one order), the weight streamed once per chunk. That outruns the blocked loop on blocks of the weight copied
   input-dim first, which this replaced: AMD EPYC (AVX-512), one thread, weights from memory in huge pages, 20
   experts of 96 / 128 / 200 rows by a 2048 x 1408 shard 102-110 / 105-109 / 104 GFLOP/s against 92-93 / 93-97 /
   96-100; 1024 rows by a full-width Qwen1.5-MoE layer's dense weights 102-105 against 99. Returns -1 where more than
   MAX_ROWS rows cannot have their transposition. */
static int linear_rows_span(const float *x, int64_t R, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                            int64_t n0, int64_t n1, const float *bias, float *out, int64_t ldo) {
    if (R > WIDE_ROWS) {
        const int64_t vectors = (R + LANES - 1) / LANES, most = WIDE_ROWS / LANES;
        const int64_t chunks = (vectors + most - 1) / most;
        for (int64_t c = 0, r = 0; c < chunks; c++) {  /* the larger chunks first: the last has the rows left */
            const int64_t whole = (vectors / chunks + (c < vectors % chunks)) * LANES;
            const int64_t here = R - r < whole ? R - r : whole;
            if (linear_rows_span(x + r * ldx, here, ldx, w, ldw, K, n0, n1, bias, out + r * ldo, ldo)) return -1;
            r += here;
        }
        return 0;
    }
    const float *xt = R > LANES / 2 ? transposed_rows(x, R, ldx, K) : NULL;
    if (xt && R > LANES) return linear_wide_span(xt, R, w, ldw, K, n0, n1, bias, out, ldo);
    if (xt) linear_lanes_span(xt, R, w, ldw, K, n0, n1, bias, out, ldo);
    else if (R <= MAX_ROWS) linear_span(x, R, ldx, w, ldw, K, n0, n1, bias, out, ldo);
    else return -1;
    return 0;
}

/* out (R x N, ldo) = x (R x K, ldx) @ w^T + bias (N, or NULL), w (N x K, ldw), any rows: returns 0, or
   -1 for a shape it does not take or a buffer it cannot have (the caller runs torch's matmul). Each thread takes one
   run of whole blocks (of the lanes' panels from LANES / 2 rows on); each output element is summed in one order
   whatever the thread count. */
/* the floats in the kernel's vector: its loops' width on this CPU */
int64_t codegen_lanes(void) { return LANES; }

int64_t codegen_linear_rows(const float *x, int64_t R, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                            int64_t N, const float *bias, float *out, int64_t ldo, int threads) {
    if (R < 1 || K < 1 || N < 1 || ldw < K || ldx < K) return -1;
    /* whole panels of every chunk past WIDE_ROWS rows: WIDE_SUMS is a multiple of each chunk's panel */
    const int64_t unit = R > WIDE_ROWS ? WIDE_SUMS : R > LANES ? WIDE_SUMS / ((R + LANES - 1) / LANES)
                       : R > LANES / 2 ? LANES_PANEL : LINEAR_BLOCK;
    const int64_t blocks = (N + unit - 1) / unit;
    const int64_t spans = threads > 1 && blocks > 1 ? (threads < blocks ? threads : blocks) : 1;
    const int64_t per = (blocks + spans - 1) / spans * unit;
    int failed = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (spans > 1) reduction(|:failed)
    for (int64_t t = 0; t < spans; t++) {
        const int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) failed |= linear_rows_span(x, R, ldx, w, ldw, K, n0, n1, bias, out + n0, ldo);
    }
    return failed ? -1 : 0;
}
"""


#: one new token per row over its cached keys, grouped heads and sinks (`decode_attention`)
_ATTENTION = r"""
typedef int32_t lane_ints __attribute__((vector_size(LANES * 4)));

/* a where the lanes of `take` are set (-1), b elsewhere */
static inline lane_vector lanes_where(lane_ints take, lane_vector a, lane_vector b) {
    lane_ints ab, bb;
    memcpy(&ab, &a, sizeof ab);
    memcpy(&bb, &b, sizeof bb);
    ab = (ab & take) | (bb & ~take);
    memcpy(&a, &ab, sizeof a);
    return a;
}

/* e^x lane by lane for x <= 0 (a score less the row's max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
   series to r^7 (relative error under 2e-7), 2^n put into the exponent's bits; below -87 0 (a masked score, or a
   share under 2^-125 of the row's largest) */
static inline lane_vector exp_lanes(lane_vector x) {
    const lane_ints normal = x >= -87.0f;  /* -1 where e^x is a normal float */
    const lane_vector xc = lanes_where(normal, x, (lane_vector){0} - 87.0f);
    const lane_ints ni = __builtin_convertvector(xc * 1.44269504088896341f + 128.5f, lane_ints) - 128;
    const lane_vector n = __builtin_convertvector(ni, lane_vector);
    const lane_vector r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    lane_vector p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120; p = p * r + 1.0f / 24; p = p * r + 1.0f / 6; p = p * r + 0.5f; p = p * r + 1.0f;
    p = p * r + 1.0f;
    const lane_ints bits = ((ni + 127) << 23) & normal;  /* 0.0f where masked */
    lane_vector scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* x = row * scale + mask (mask: stride sms, or NULL), then e^(x - max) in place over row[0..n) (row padded to a whole
   vector: `padded`, its tail set to -inf here), max taken with the sink's logit; returns 1 / the row's sum, the
   sink's e^(sink - max) in it (with_sink) but not in the row */
static float exp_row(float *row, int64_t n, int64_t padded, float scale, const float *mask, int64_t sms, float sink,
                     int with_sink) {
    lane_vector most = (lane_vector){0} + (with_sink ? sink : -INFINITY);
    const int64_t whole = n / LANES * LANES;
    for (int64_t s = 0; s < whole; s += LANES) {  /* in vector registers: the scalar loop cost 2 ns a score */
        lane_vector x = *(lane_vector *)(row + s) * scale;
        if (mask && sms == 1) x += *(const lane_vector *)(mask + s);
        else if (mask) for (int i = 0; i < LANES; i++) x[i] += mask[(s + i) * sms];
        *(lane_vector *)(row + s) = x;
        most = lanes_where(x > most, x, most);
    }
    float m = most[0];
    for (int i = 1; i < LANES; i++) m = most[i] > m ? most[i] : m;
    for (int64_t s = whole; s < n; s++) {
        row[s] = row[s] * scale + (mask ? mask[s * sms] : 0.0f);
        m = row[s] > m ? row[s] : m;
    }
    for (int64_t s = n; s < padded; s++) row[s] = -INFINITY;
    lane_vector total = {0};
    for (int64_t s = 0; s < padded; s += LANES) {
        const lane_vector e = exp_lanes(*(lane_vector *)(row + s) - m);
        *(lane_vector *)(row + s) = e;
        total += e;
    }
    float sum = with_sink ? expf(sink - m) : 0.0f;
    for (int i = 0; i < LANES; i++) sum += total[i];
    return 1.0f / sum;
}

#define ATTENTION_HEADS 16   /* query heads per kv head the kernel takes */
#define ATTENTION_VECTORS (256 / LANES) /* head_dim / LANES it takes: head_dim up to 256 */

/* Attention of one new token per row over its cached keys (a decode step), grouped heads and optional per-head
   sinks: out (B, Hq, D) contiguous = the values weighted by softmax([q.k * scale + mask, sink]) without the sink's
   own share. Each kv head's keys and values are read once for its Hq / Hkv query heads, the scores of a vector of
   keys summed at once. q (B, Hq, D), k and v (B, Hkv, S, D), any strides with D's 1; mask (B, S) additive with
   strides smb, sms (NULL: none); sinks (Hq) or NULL. Returns 0, -1 for shapes it does not take, -2 when out of
   memory. */
int64_t codegen_decode_attention(const float *q, int64_t B, int64_t Hq, int64_t D, int64_t sqb, int64_t sqh,
                                 const float *k, const float *v, int64_t Hkv, int64_t S, int64_t skb, int64_t skh,
                                 int64_t sks, int64_t svb, int64_t svh, int64_t svs, const float *mask, int64_t smb,
                                 int64_t sms, const float *sinks, float scale, float *out, int threads) {
    if (B < 1 || Hkv < 1 || Hq % Hkv || Hq / Hkv > ATTENTION_HEADS || D % LANES || D > LANES * ATTENTION_VECTORS
        || S < 1)
        return -1;
    const int64_t G = Hq / Hkv, DV = D / LANES, SP = (S + LANES - 1) / LANES * LANES;
    float *buffer = (float *)malloc(B * Hkv * G * SP * sizeof(float));
    if (!buffer) return -2;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            float *scores = buffer + (b * Hkv + h) * G * SP;
            const float *kb = k + b * skb + h * skh, *vb = v + b * svb + h * svh;
            lane_vector qv[ATTENTION_VECTORS];
            /* scores, a vector of keys at a time: their rows stay in L1 while each head of the group takes them */
            for (int64_t s0 = 0; s0 < S; s0 += LANES) {
                const int64_t n = S - s0 < LANES ? S - s0 : LANES;
                lane_vector add = {0};
                if (mask) for (int64_t i = 0; i < n; i++) add[i] = mask[b * smb + (s0 + i) * sms];
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = q + b * sqb + (h * G + g) * sqh;
                    for (int64_t j = 0; j < DV; j++) qv[j] = *(const lane_vector *)(qg + j * LANES);
                    lane_vector dots[LANES];
                    for (int64_t i = 0; i < LANES; i++) {
                        const float *kr = kb + (s0 + (i < n ? i : 0)) * sks;
                        lane_vector acc = qv[0] * *(const lane_vector *)kr;
                        for (int64_t j = 1; j < DV; j++) acc += qv[j] * *(const lane_vector *)(kr + j * LANES);
                        dots[i] = acc;
                    }
                    *(lane_vector *)(scores + g * SP + s0) = lanes_summed(dots) * scale + add;
                }
            }
            /* softmax with the sink: e^(score - max) over the keys, the sink in the sum only */
            float inv[ATTENTION_HEADS];
            for (int64_t g = 0; g < G; g++)
                inv[g] = exp_row(scores + g * SP, S, SP, 1.0f, NULL, 0, sinks ? sinks[h * G + g] : 0.0f,
                                 sinks != NULL);  /* scaled and masked as they were summed */
            /* values: each row once for as many of the group's heads as have their sums fit in registers */
            const int64_t per = DV < ATTENTION_SUMS ? ATTENTION_SUMS / DV : 1;
            for (int64_t g0 = 0; g0 < G; g0 += per) {
                const int64_t gn = G - g0 < per ? G - g0 : per;
                lane_vector acc[ATTENTION_VECTORS];
                for (int64_t a = 0; a < gn * DV; a++) acc[a] = (lane_vector){0};
                for (int64_t s = 0; s < S; s++) {
                    const float *vr = vb + s * svs;
                    for (int64_t j = 0; j < DV; j++) {
                        const lane_vector vv = *(const lane_vector *)(vr + j * LANES);
                        for (int64_t g = 0; g < gn; g++) acc[g * DV + j] += scores[(g0 + g) * SP + s] * vv;
                    }
                }
                for (int64_t g = 0; g < gn; g++) {
                    float *row = out + (b * Hq + h * G + g0 + g) * D;
                    for (int64_t j = 0; j < DV; j++) *(lane_vector *)(row + j * LANES) = acc[g * DV + j] * inv[g0 + g];
                }
            }
        }
    free(buffer);
    return 0;
}
"""

_PREFILL_ATTENTION = r"""
/* BLAS's sgemm (Fortran interface, column-major), the one torch's CPU matmul calls: its address comes from the caller */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);

/* c (rows x N, ldc) = a (rows x K, lda) @ b, b (K x N) with element strides (sk, sn), one of them 1: as sgemm sees
   it, c^T = b^T a^T */
static void matmul_by_blas(sgemm_fn sgemm, const float *a, int64_t lda, const float *b, int64_t sk, int64_t sn,
                           int64_t K, int64_t N, int64_t rows, float *c, int64_t ldc) {
    const int m = (int)N, n = (int)rows, k = (int)K, ldb = (int)lda, ldcc = (int)ldc, ldw = (int)(sn == 1 ? sk : sn);
    const float one = 1.f, zero = 0.f;
    sgemm(sn == 1 ? "N" : "T", "N", &m, &n, &k, &one, b, &ldw, a, &ldb, &zero, c, &ldcc);
}

#define PREFILL_ROWS 32  /* query rows per task: their scores (rows x keys) stay in L2, and a causal mask lets a block
                            skip the keys every row of it masks */

/* the key columns [lo, hi) that some row of a block does not mask (an additive mask's masked entries are its dtype's
   min or -inf: they add e^(min - max) = 0 to a row's sum); all of them where a row masks every key (its softmax is
   then over all of them, as eager's) */
static void unmasked_columns(const float *mask, int64_t smq, int64_t sms, int64_t rows, int64_t S, int64_t *lo,
                             int64_t *hi) {
    int64_t first = S, last = -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *mr = mask + r * smq;
        int64_t a = 0, z = S - 1;
        while (a < S && mr[a * sms] <= -FLT_MAX) a++;
        if (a == S) { *lo = 0; *hi = S; return; }
        while (mr[z * sms] <= -FLT_MAX) z--;
        if (a < first) first = a;
        if (z > last) last = z;
    }
    *lo = first; *hi = last + 1;
}

/* Attention of Q query rows per sequence over S keys (a prefill), grouped heads, optional per-head sinks and an
   additive mask: out (B, Q, Hq, D) contiguous (eager attention's layout) = the values weighted by softmax([q.k *
   scale + mask, sink]) without the sink's own share. Each task is one sequence, kv head and block of query rows:
   for each query head of the group, the scores of the keys some row of the block does not mask by BLAS's sgemm, the
   softmax in vector registers, then the weighted values by sgemm. q (B, Hq, Q, D) with strides (sqb, sqh, sqq), k
   and v (B, Hkv, S, D), D's stride 1 throughout; mask (B, Q, S) with strides (smb, smq, sms) or NULL; sinks (Hq) or
   NULL. Returns 0, -1 for shapes it does not take, -2 when out of memory. */
int64_t codegen_prefill_attention(const float *q, int64_t B, int64_t Hq, int64_t Q, int64_t D, int64_t sqb,
                                  int64_t sqh, int64_t sqq, const float *k, const float *v, int64_t Hkv, int64_t S,
                                  int64_t skb, int64_t skh, int64_t sks, int64_t svb, int64_t svh, int64_t svs,
                                  const float *mask, int64_t smb, int64_t smq, int64_t sms, const float *sinks,
                                  float scale, float *out, void *sgemm_address, int threads) {
    const sgemm_fn sgemm = (sgemm_fn)sgemm_address;
    if (!sgemm || B < 1 || Q < 1 || S < 1 || Hkv < 1 || Hq % Hkv || D < 1) return -1;
    const int64_t G = Hq / Hkv, rows = Q < PREFILL_ROWS ? Q : PREFILL_ROWS, blocks = (Q + rows - 1) / rows;
    const int64_t SP = (S + LANES - 1) / LANES * LANES, tasks = B * Hkv * blocks;
    int64_t failed = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / (Hkv * blocks), h = t / blocks % Hkv, q0 = t % blocks * rows;
        const int64_t n = Q - q0 < rows ? Q - q0 : rows;
        const float *mb = mask ? mask + b * smb + q0 * smq : NULL;
        float *scores = (float *)malloc(rows * SP * sizeof(float));
        if (!scores) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        int64_t lo = 0, hi = S;
        if (mb) unmasked_columns(mb, smq, sms, n, S, &lo, &hi);
        const int64_t width = hi - lo, ld = (width + LANES - 1) / LANES * LANES;
        for (int64_t g = 0; g < G; g++) {
            const int64_t head = h * G + g;
            matmul_by_blas(sgemm, q + b * sqb + head * sqh + q0 * sqq, sqq, k + b * skb + h * skh + lo * sks, 1, sks,
                           D, width, n, scores, ld);
            for (int64_t r = 0; r < n; r++) {
                float *sr = scores + r * ld;
                const float inv = exp_row(sr, width, ld, scale, mb ? mb + r * smq + lo * sms : NULL, sms,
                                          sinks ? sinks[head] : 0.0f, sinks != NULL);
                for (int64_t s = 0; s < ld; s += LANES) *(lane_vector *)(sr + s) *= inv;
            }
            matmul_by_blas(sgemm, scores, ld, v + b * svb + h * svh + lo * svs, svs, 1, width, D, n,
                           out + ((b * Q + q0) * Hq + head) * D, Hq * D);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
"""


def _task_for(task: str, suffix: str, weight: str, load: str) -> str:
    return (task.replace("_TYPE(", f"_{suffix}(").replace("WEIGHT", weight)
            .replace("LOAD(", f"{load}(" if load else "("))


_BF16 = ("bf16", "uint16_t", "f32_of_bf16")
#: the kernel's C source: float32 and bfloat16 weights, float32 rows and sums
GROUPED_MM_SOURCE = (_HEAD + _task_for(_ROWS_TASK, *_BF16)
                     + _task_for(_COLUMNS_TASK, *_BF16) + _LINEAR + _ATTENTION + _ENTRY + _FUSED
                     + _PREFILL_ATTENTION)
#: the gates the fused experts compute, by their code in the C source (GATE_SILU, GATE_CLAMPED_SWIGLU there)
GATE_CODES = {GATE_SILU: 0, GATE_CLAMPED_SWIGLU: 1}
#: the weight dtypes the kernel reads
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

def _c_compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _kernel_path(compiler, flags):
    """Where this source, built by this compiler for this CPU, lives: keyed by all three."""
    digest = hashlib.sha256(GROUPED_MM_SOURCE.encode())
    for part in (compiler, " ".join(flags), platform.machine(), _cpu_flags()):
        digest.update(b"\0" + part.encode())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest.update(version.encode())
    return os.path.join(extensions_dir(), f"codegen_grouped_mm-{digest.hexdigest()[:16]}.so")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build_kernel(compiler, flags, path):
    """Compile into a file of this process's own, then move it into place (ranks build side by side)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as work:
        source = os.path.join(work, "grouped_mm.c")
        with open(source, "w") as handle:
            handle.write(GROUPED_MM_SOURCE)
        built = os.path.join(work, "grouped_mm.so")
        done = subprocess.run([compiler, *flags, source, "-o", built, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise OSError(f"{compiler} failed: {lines[-1] if lines else done.returncode}")
        os.replace(built, path)


@functools.lru_cache(maxsize=None)
def grouped_mm_kernel(extra_flags: tuple = ()):
    """The loaded kernel (a ctypes function), or None where it cannot be had here (the reason is said once).
    `extra_flags`: more compiler flags, a build of its own (the tests build the 8-float vectors' loops on a CPU with
    AVX-512 through `-mno-avx512f`, so that both widths are checked wherever they run)."""
    # fused multiply-adds where the CPU has them (ISO C's default, off, runs the dense loop's tile 10% slower)
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99", "-ffp-contract=fast",
             f"-DMAX_ROWS={SMALL_GROUP_ROWS}", f"-DWIDE_ROWS={DENSE_KERNEL_ROWS}", *extra_flags]
    try:
        compiler = _c_compiler()
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        path = _kernel_path(compiler, flags)
        if not os.path.exists(path):
            _build_kernel(compiler, flags, path)
        library = ctypes.CDLL(path)
        function = library.codegen_grouped_mm
    except (OSError, subprocess.SubprocessError) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        print(f"codegen policy: the grouped-matmul kernel cannot be built here ({why}); the experts run torch's "
              "matmul one by one", file=sys.stderr, flush=True)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, i64, i64, ptr, ctypes.c_int, i64, i64, i64, ptr, i64,
                         ctypes.c_int]
    function.restype = i64
    fused = library.codegen_fused_experts
    fused.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64, ptr, i64,
                      ptr, i64, ctypes.c_int, ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int]
    fused.restype = i64
    function.fused = fused
    linear = library.codegen_linear_rows
    linear.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_int]
    linear.restype = i64
    function.linear = linear
    lanes = library.codegen_lanes
    lanes.restype = i64
    function.lanes = lanes()
    # the rows from which `linear_rows` leaves a product to torch whatever its weight
    function.dense_rows_below = sys.maxsize if function.lanes >= 16 else NARROW_DENSE_ROWS
    attention = library.codegen_decode_attention
    attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ptr, i64,
                          i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    attention.restype = i64
    function.decode_attention = attention
    prefill = library.codegen_prefill_attention
    prefill.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, i64, ptr,
                        i64, i64, i64, ptr, ctypes.c_float, ptr, ptr, ctypes.c_int]
    prefill.restype = i64
    function.prefill_attention = prefill
    return function


@functools.lru_cache(maxsize=1)
def blas_sgemm_address():
    """The address of the BLAS `sgemm_` torch's CPU matmul calls (MKL in torch's x86 wheels), or None where torch's
    library does not export one: the fused experts multiply their large groups with it."""
    library = os.path.join(os.path.dirname(torch.__file__), "lib",
                           "libtorch_cpu.dylib" if sys.platform == "darwin" else "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(library).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def fused_experts_available():
    """Whether `fused_experts` can run here: the kernel built."""
    return grouped_mm_kernel() is not None


def fused_experts(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None,
                  gate=GATE_SILU, alpha=0.0, limit=0.0):
    """For each token (rows of `hidden`, float32), the sum over its routed experts of the routing weight times
    down(gate(hidden @ gate_up[e] + gate_up_bias[e])) + down_bias[e]: gate_up (E, H, 2I), down (E, I, H), any strides
    with `in` or `out` 1, the biases optional, `gate` one of GATE_CODES. One C call: each expert's rows are gathered,
    multiplied, gated and added while they are in cache, where transformers' grouped path writes and reads every
    routed row (tokens x top-k) in memory at each step: measured, toy Qwen3-MoE widths, 2048 tokens (a batch-16
    prefill), one thread, 28 ms against 81 ms a layer (eager)."""
    kernel, threads = grouped_mm_kernel(), torch.get_num_threads()
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    index = top_k_index.to(torch.int64).contiguous()
    weights = top_k_weights.to(torch.float32).contiguous()
    biases = [b if b is None or b.stride(-1) == 1 else b.contiguous() for b in (gate_up_bias, down_bias)]
    bias_args = [value for b in biases for value in ((None, 0) if b is None else (b.data_ptr(), b.stride(0)))]
    out = x.new_empty(x.shape[0], x.shape[1])
    status = kernel.fused(x.data_ptr(), x.shape[0], x.stride(0), index.data_ptr(), weights.data_ptr(), index.shape[1],
                          gate_up.shape[0], gate_up.data_ptr(), *gate_up.stride(), down.data_ptr(), *down.stride(),
                          x.shape[1], gate_up.shape[2], *bias_args, GATE_CODES[gate], alpha, limit, out.data_ptr(),
                          threads)
    if status != 0:
        raise RuntimeError("codegen fused experts: " + ("out of memory" if status == -2 else
                                                        "an expert id outside the experts, or weights it does not take"))
    return out


def decode_attention(query, key, value, mask, sinks, scale):
    """One new token per row attending to its cached keys: (B, 1, Hq, D), the layout eager attention returns.

    query (B, Hq, 1, D), key and value (B, Hkv, S, D) (a cache store's views), all float32 on CPU; mask additive,
    broadcastable to (B, 1, 1, S), or None; sinks (Hq,) or None: a per-head logit in the softmax's sum only, as
    GPT-OSS's. The caller checks the shapes first (codegen.policy.runtime.eager_attention's `kernel_takes`)."""
    kernel = grouped_mm_kernel()
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    rows = None if mask is None else mask.expand(batch, 1, 1, length)[:, 0, 0, :]
    head_sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    out = q.new_empty(batch, 1, heads, dim)
    status = kernel.decode_attention(
        q.data_ptr(), batch, heads, dim, q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), kv_heads, length,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        None if rows is None else rows.data_ptr(), 0 if rows is None else rows.stride(0),
        0 if rows is None else rows.stride(1), None if head_sinks is None else head_sinks.data_ptr(), scale,
        out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError("codegen decode attention: "
                           + ("out of memory" if status == -2 else "shapes it does not take"))
    return out


def prefill_attention(query, key, value, mask, sinks, scale):
    """Several new tokens per row attending to their keys (a prefill): (B, Q, Hq, D), the layout eager attention
    returns. query (B, Hq, Q, D), key and value (B, Hkv, S, D), all float32 on CPU; mask additive, broadcastable to
    (B, 1, Q, S), or None; sinks (Hq,) or None. The caller checks the shapes first."""
    kernel = grouped_mm_kernel()
    batch, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    # BLAS takes rows at least a row's width apart (an expanded tensor's are not)
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) >= dim else t.contiguous() for t in (query, key, value))
    masks = None if mask is None else mask.expand(batch, 1, rows, length)[:, 0]
    head_sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
    out = q.new_empty(batch, rows, heads, dim)
    mask_args = (None, 0, 0, 0) if masks is None else (masks.data_ptr(), *masks.stride())
    status = kernel.prefill_attention(
        q.data_ptr(), batch, heads, rows, dim, *q.stride()[:3], k.data_ptr(), v.data_ptr(), kv_heads, length,
        *k.stride()[:3], *v.stride()[:3], *mask_args, None if head_sinks is None else head_sinks.data_ptr(), scale,
        out.data_ptr(), blas_sgemm_address(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError("codegen prefill attention: "
                           + ("out of memory" if status == -2 else "shapes it does not take"))
    return out

def experts_grouped_mm(input, weight, offs):
    """(S, in) rows sorted by expert @ (E, in, out) per expert, `offs` the groups' ends; rows past the last group
    are 0 (as transformers' fallback leaves them). float32 groups run in the kernel, bfloat16 ones up to
    `SMALL_GROUP_ROWS` rows (the rest in torch's matmul).

    bfloat16 weights are read as they are (half the bytes of float32) and summed in float32, as torch's matmul
    does; the rows go to the kernel in float32 and the result comes back in the rows' dtype."""
    on_cpu = input.device.type == weight.device.type == offs.device.type == "cpu"
    takes = on_cpu and input.dtype == weight.dtype and weight.dtype in KERNEL_DTYPES
    kernel = grouped_mm_kernel() if takes else None
    if kernel is not None and offs.dtype in (torch.int32, torch.int64):
        x = input.float()
        x = x if x.stride(-1) == 1 else x.contiguous()
        offs = offs.contiguous()
        sums = x.new_empty(input.shape[0], weight.shape[-1])
        large = kernel(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), weight.dtype == torch.bfloat16,
                       *weight.stride(), offs.data_ptr(), offs.dtype == torch.int64, weight.shape[0],
                       weight.shape[1], weight.shape[2], sums.data_ptr(), sums.stride(0), torch.get_num_threads())
        output = sums.to(input.dtype)
        if large == 0:
            return output
        if large > 0:
            return _matmul_per_expert(input, weight, offs, output, more_than=kernel_rows(weight))
    return _matmul_per_expert(input, weight, offs, input.new_zeros(input.shape[0], weight.shape[-1]))


def kernel_rows(weight):
    """The most rows an expert of `weight` (E, in, out) has in the kernel (its C `kernel_rows`): float32 any (its
    blocked loop outruns torch's matmul at every row count measured), bfloat16 up to `SMALL_GROUP_ROWS`."""
    return sys.maxsize if weight.dtype == torch.float32 else SMALL_GROUP_ROWS


def _matmul_per_expert(input, weight, offs, output, more_than=0):
    """torch's matmul for each expert with more than `more_than` rows, into `output`."""
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end - start > more_than:
            torch.mm(input[start:end], weight[expert], out=output[start:end])
        start = max(start, end)
    return output


def linear_rows(input, weight, bias=None):
    """`input @ weight.T + bias` (nn.Linear's product) through the kernel, float32 on CPU, `weight` (out, in) with `in`
    contiguous: a decode step's or a prompt's rows through its dense loop, fewer than `ONEDNN_ROWS` rows by any weight
    or any rows by a weight of `DENSE_KERNEL_WIDE_WEIGHT` elements or more (past `DENSE_KERNEL_ROWS` in chunks of at
    most that many): it streams a weight from memory faster than torch's BLAS and oneDNN pack it (AMD EPYC, AVX-512,
    one thread, 1024 rows by a full-width Qwen1.5-MoE layer's dense weights from memory in huge pages: 108 GFLOP/s,
    `F.linear` 90-93). A prompt's `ONEDNN_ROWS` or more rows by a smaller weight go to oneDNN's sgemm (the same
    machine, a batch-16 prefill of toy GPT-OSS and Qwen1.5-MoE widths on 2 ranks: 282 -> 263 and 311 -> 287 ms against
    torch's MKL; without AVX-512 they are torch's, `ONEDNN_OUTRUNS_TORCH`); any other call is torch's own. Where the
    kernel's vectors are 8 floats (no AVX-512), `NARROW_DENSE_ROWS` rows or more are torch's whatever the weight.
    It runs for every dense product of a decode step, so its checks are plain attribute reads (a call costs about
    what `F.linear`'s dispatch does)."""
    width, f32 = input.shape[-1], torch.float32
    rows = input.numel() // width if width else 0
    wide = weight.numel() >= DENSE_KERNEL_WIDE_WEIGHT
    # a float32 (out, in) product on CPU with a bias of its outputs: what the kernel and oneDNN's op both compute
    dense = (input.is_cpu and weight.is_cpu and input.dtype is f32 and weight.dtype is f32 and weight.dim() == 2
             and weight.shape[1] == width
             and (bias is None or (bias.is_cpu and bias.dtype is f32 and bias.shape == weight.shape[:1])))
    takes = 1 <= rows and (wide or rows < ONEDNN_ROWS) and dense and weight.stride(1) == 1
    kernel = grouped_mm_kernel() if takes else None
    if kernel is not None and rows >= kernel.dense_rows_below:
        kernel = None
    if kernel is None:
        # oneDNN's op takes contiguous weights and biases only, and has no backward
        if (rows >= ONEDNN_ROWS and dense and ONEDNN_LINEAR and ONEDNN_OUTRUNS_TORCH and weight.is_contiguous()
                and (bias is None or bias.is_contiguous()) and not torch.is_grad_enabled()):
            return torch.ops.mkldnn._linear_pointwise(input if input.is_contiguous() else input.contiguous(), weight,
                                                      bias, "none", [], "")
        return torch.nn.functional.linear(input, weight, bias)
    x = input.view(rows, width) if input.is_contiguous() else input.reshape(rows, width)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = input.new_empty((*input.shape[:-1], weight.shape[0]))  # contiguous: its rows weight.shape[0] apart
    status = kernel.linear(x.data_ptr(), rows, x.stride(0), weight.data_ptr(), weight.stride(0), width,
                           weight.shape[0], None if bias is None else bias.data_ptr(), out.data_ptr(), weight.shape[0],
                           torch.get_num_threads())
    if status != 0:
        return torch.nn.functional.linear(input, weight, bias)
    return out

