"""The grouped matmul of a decode step's routed experts, as one C loop over the experts that have rows.

A decode step routes each token to a few experts, so every expert's matmul has 1-16 rows: a matrix-vector
product that should stream the expert's weights from memory once. torch's CPU matmul runs such products at a third
of the machine's read bandwidth and pays ~7 us of dispatch each, and a batch-16 step of toy Qwen3-MoE widths issues
~670 of them. This kernel visits every expert with 1..`SMALL_GROUP_ROWS` rows in one call, streaming each weight in
its memory order; experts with more rows (prefill) are left to torch's matmul. Measured (toy Qwen3-MoE widths, batch
16, its 4 layers' experts, float32, one thread): 7.4 ms against 20.3 ms with torch's matmul per expert, 6.9 ms to
only read the weights; its compiled decode step on 2 ranks went from 28 to 17 ms. Weights stored row-major (input
dim first, as GPT-OSS keeps them) are applied four weight rows at a time to accumulators that stay in L1, a task
spanning as many columns as those fit, so the weight streams in long runs: on an Intel Xeon (AVX-512), one thread,
GPT-OSS-20b's experts at TP=2 widths went from 8.7 to 14.2 GB/s at batch 1 and from 6.4 to 10.0 at batch 16 (torch
reads 11-12 GB/s there); column-major weights stream at torch's read rate already, unchanged. bfloat16 weights are
read as they are and summed in float32 (the rows converted to float32 first): transformers runs `torch._grouped_mm`
in bfloat16, whose CPU kernel visits every expert (scripts/experts_kernel_bench.py: this loop is 1.33-1.84x it at
batch 1 at the bench's published widths, 0.97-1.17x at batch 16).

It is built once per machine (the system C compiler, `-O3 -march=native`, OpenMP on torch's own runtime) into this
environment's build dir, keyed by its source, the compiler and the CPU; where it cannot be built, the caller runs
torch's matmul per expert and says why once.
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

from codegen.policy.runtime.environment import extensions_dir

#: experts with at most this many rows go to the kernel; more (prefill) go to torch's matmul, which packs the
#: weight once and wins from there on
SMALL_GROUP_ROWS = 16

_HEAD = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MAX_ROWS
#error "build with -DMAX_ROWS=<SMALL_GROUP_ROWS>"
#endif
#define ACC_FLOATS 4096  /* one task's accumulators (rows x columns, 16 KiB): they stay in L1 */
#define MIN_BLOCK 64
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

#: the two task shapes, for one weight element type: `WEIGHT` the C type, `LOAD(v)` its value as a float, `TYPE`
#: the functions' suffix. The rows (x) and the sums are float32 whatever the weights are.
_TASKS = r"""
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

/* weight column-major (w[n * sn + k]): a column at a time, read once for up to four rows (four independent sums;
   weight columns read side by side stream several times slower: measured). A column of at most a page has the
   next one prefetched while it is summed (measured: bfloat16 columns of 2048 went from 7 to 10 GB/s; float32
   columns of 2048, 8 KiB, stream as fast or faster without) */
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
/* out = x @ w per expert group, x (S, K) float32 rows sorted by expert, w (E, K, N) float32 or (wbf16) bfloat16 with
   strides (se, sk, sn), sk == 1 or sn == 1, out (S, N) float32. Computes the groups with 1..MAX_ROWS rows and zeroes
   the rows past the last group; returns how many groups have more rows (the caller computes those), or -1 if the
   layout is not one it takes or the offsets point past x. */
int64_t codegen_grouped_mm(const float *x, int64_t S, int64_t ldx, const void *w, int wbf16, int64_t se, int64_t sk,
                           int64_t sn, const void *offs, int offs64, int64_t E, int64_t K, int64_t N,
                           float *out, int64_t ldo, int threads) {
    if (sn != 1 && sk != 1) return -1;
    int64_t *small = (int64_t *)malloc((E > 0 ? E : 1) * sizeof(int64_t));
    if (!small) return -1;
    int64_t nsmall = 0, large = 0, last = 0, most = 1;
    for (int64_t e = 0; e < E; e++) {
        int64_t start, end;
        group(offs, offs64, e, &start, &end);
        if (end > S || start < 0) { free(small); return -1; }  /* not offsets into x: left to the caller's torch */
        if (end - start > MAX_ROWS) large++;
        else if (end > start) { small[nsmall++] = e; if (end - start > most) most = end - start; }
        if (end > last) last = end;
    }
    for (int64_t r = last; r < S; r++) memset(out + r * ldo, 0, N * sizeof(float));
    /* columns per task: as many as the most rows' accumulators allow (row-major weights), or a fixed share */
    int64_t block = sn == 1 ? (ACC_FLOATS / most) / 16 * 16 : 256;
    if (block < MIN_BLOCK) block = MIN_BLOCK;
    const int64_t blocks = (N + block - 1) / block, tasks = nsmall * blocks;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
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
            if (sn == 1) by_weight_rows_f32(xg, ldx, we, sk, K, rows, nb, og, ldo);
            else by_weight_columns_f32(xg, ldx, we, sn, K, rows, nb, og, ldo);
        }
    }
    free(small);
    return large;
}
"""


def _tasks_for(suffix: str, weight: str, load: str) -> str:
    return (_TASKS.replace("_TYPE(", f"_{suffix}(").replace("WEIGHT", weight)
            .replace("LOAD(", f"{load}(" if load else "("))


#: the kernel's C source: float32 and bfloat16 weights, float32 rows and sums
GROUPED_MM_SOURCE = (_HEAD + _tasks_for("f32", "float", "") + _tasks_for("bf16", "uint16_t", "f32_of_bf16")
                     + _ENTRY)
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
        done = subprocess.run([compiler, *flags, source, "-o", built], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise OSError(f"{compiler} failed: {lines[-1] if lines else done.returncode}")
        os.replace(built, path)


@functools.lru_cache(maxsize=1)
def grouped_mm_kernel():
    """The loaded kernel (a ctypes function), or None where it cannot be had here (the reason is said once)."""
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99", f"-DMAX_ROWS={SMALL_GROUP_ROWS}"]
    try:
        compiler = _c_compiler()
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or clang) on PATH")
        path = _kernel_path(compiler, flags)
        if not os.path.exists(path):
            _build_kernel(compiler, flags, path)
        function = ctypes.CDLL(path).codegen_grouped_mm
    except (OSError, subprocess.SubprocessError) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        print(f"codegen policy: the grouped-matmul kernel cannot be built here ({why}); the experts run torch's "
              "matmul one by one", file=sys.stderr, flush=True)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, i64, i64, i64, ptr, ctypes.c_int, i64, i64, i64, ptr, i64,
                         ctypes.c_int]
    function.restype = i64
    return function


def experts_grouped_mm(input, weight, offs):
    """(S, in) rows sorted by expert @ (E, in, out) per expert, `offs` the groups' ends; rows past the last group
    are 0 (as transformers' fallback leaves them). Small groups run in the kernel, the rest in torch's matmul.

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
            return _matmul_per_expert(input, weight, offs, output, more_than=SMALL_GROUP_ROWS)
    return _matmul_per_expert(input, weight, offs, input.new_zeros(input.shape[0], weight.shape[-1]))


def _matmul_per_expert(input, weight, offs, output, more_than=0):
    """torch's matmul for each expert with more than `more_than` rows, into `output`."""
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end - start > more_than:
            torch.mm(input[start:end], weight[expert], out=output[start:end])
        start = max(start, end)
    return output
