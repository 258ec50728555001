"""The grouped matmul of a decode step's routed experts, as one C loop over the experts that have rows.

A decode step routes each token to a few experts, so every expert's matmul has 1-16 rows: a matrix-vector
product that should stream the expert's weights from memory once. torch's CPU matmul runs such products at a third
of the machine's read bandwidth and pays ~7 us of dispatch each, and a batch-16 step of toy Qwen3-MoE widths issues
~670 of them. This kernel visits every expert with 1..`SMALL_GROUP_ROWS` rows in one call, streaming each weight in
its memory order; experts with more rows (prefill) are left to torch's matmul. Measured (toy Qwen3-MoE widths, batch
16, its 4 layers' experts, float32, one thread): 7.4 ms against 20.3 ms with torch's matmul per expert, 6.9 ms to
only read the weights; its compiled decode step on 2 ranks went from 28 to 17 ms.

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

GROUPED_MM_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef MAX_ROWS
#error "build with -DMAX_ROWS=<SMALL_GROUP_ROWS>"
#endif
#define BLOCK 256  /* output columns per task */

/* start and end row of expert e: offs holds each group's end (int32 or int64) */
static inline void group(const void *offs, int offs64, int64_t e, int64_t *start, int64_t *end) {
    if (offs64) { *start = e ? ((const int64_t *)offs)[e - 1] : 0; *end = ((const int64_t *)offs)[e]; }
    else { *start = e ? ((const int32_t *)offs)[e - 1] : 0; *end = ((const int32_t *)offs)[e]; }
}

/* out[r, n0:n0+nb] for the rows of one expert, its weight row-major (w[k * sk + n], n contiguous): each weight row
   is read once and applied to every row of the group */
static void by_weight_rows(const float *x, int64_t ldx, const float *w, int64_t sk, int64_t K, int64_t rows,
                           int64_t nb, float *out, int64_t ldo) {
    float acc[MAX_ROWS][BLOCK];
    for (int64_t r = 0; r < rows; r++) memset(acc[r], 0, nb * sizeof(float));
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * sk;
        for (int64_t r = 0; r < rows; r++) {
            const float xv = x[r * ldx + k];
            float *a = acc[r];
            #pragma omp simd
            for (int64_t n = 0; n < nb; n++) a[n] += xv * wk[n];
        }
    }
    for (int64_t r = 0; r < rows; r++) memcpy(out + r * ldo, acc[r], nb * sizeof(float));
}

/* the same, the weight column-major (w[n * sn + k], k contiguous): a dot product per column and row, one column
   at a time (weight columns read side by side stream several times slower: measured) */
static void by_weight_columns(const float *x, int64_t ldx, const float *w, int64_t sn, int64_t K, int64_t rows,
                              int64_t nb, float *out, int64_t ldo) {
    for (int64_t n = 0; n < nb; n++) {
        const float *wn = w + n * sn;
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * ldx;
            float s = 0.f;
            #pragma omp simd reduction(+:s)
            for (int64_t k = 0; k < K; k++) s += xr[k] * wn[k];
            out[r * ldo + n] = s;
        }
    }
}

/* out = x @ w per expert group, x (S, K) rows sorted by expert, w (E, K, N) with strides (se, sk, sn), sk == 1 or
   sn == 1, out (S, N). Computes the groups with 1..MAX_ROWS rows and zeroes the rows past the last group; returns
   how many groups have more rows (the caller computes those), or -1 if the layout is not one it takes or the
   offsets point past x. */
int64_t codegen_grouped_mm_f32(const float *x, int64_t S, int64_t ldx, const float *w, int64_t se, int64_t sk,
                               int64_t sn, const void *offs, int offs64, int64_t E, int64_t K, int64_t N,
                               float *out, int64_t ldo, int threads) {
    if (sn != 1 && sk != 1) return -1;
    int64_t *small = (int64_t *)malloc((E > 0 ? E : 1) * sizeof(int64_t));
    if (!small) return -1;
    int64_t nsmall = 0, large = 0, last = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t start, end;
        group(offs, offs64, e, &start, &end);
        if (end > S || start < 0) { free(small); return -1; }  /* not offsets into x: left to the caller's torch */
        if (end - start > MAX_ROWS) large++;
        else if (end > start) small[nsmall++] = e;
        if (end > last) last = end;
    }
    for (int64_t r = last; r < S; r++) memset(out + r * ldo, 0, N * sizeof(float));
    const int64_t blocks = (N + BLOCK - 1) / BLOCK, tasks = nsmall * blocks;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t e = small[t / blocks], n0 = (t % blocks) * BLOCK;
        const int64_t nb = N - n0 < BLOCK ? N - n0 : BLOCK;
        int64_t start, end;
        group(offs, offs64, e, &start, &end);
        const float *xg = x + start * ldx, *we = w + e * se + n0 * sn;
        float *og = out + start * ldo + n0;
        if (sn == 1) by_weight_rows(xg, ldx, we, sk, K, end - start, nb, og, ldo);
        else by_weight_columns(xg, ldx, we, sn, K, end - start, nb, og, ldo);
    }
    free(small);
    return large;
}
"""

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
        function = ctypes.CDLL(path).codegen_grouped_mm_f32
    except (OSError, subprocess.SubprocessError) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        print(f"codegen policy: the grouped-matmul kernel cannot be built here ({why}); the experts run torch's "
              "matmul one by one", file=sys.stderr, flush=True)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ctypes.c_int]
    function.restype = i64
    return function


def experts_grouped_mm(input, weight, offs):
    """(S, in) rows sorted by expert @ (E, in, out) per expert, `offs` the groups' ends; rows past the last group
    are 0 (as transformers' fallback leaves them). Small groups run in the kernel, the rest in torch's matmul."""
    on_cpu = input.device.type == weight.device.type == offs.device.type == "cpu"
    kernel = grouped_mm_kernel() if on_cpu and input.dtype == weight.dtype == torch.float32 else None
    if kernel is not None and offs.dtype in (torch.int32, torch.int64):
        x = input if input.stride(-1) == 1 else input.contiguous()
        offs = offs.contiguous()
        output = input.new_empty(input.shape[0], weight.shape[-1])
        large = kernel(x.data_ptr(), x.shape[0], x.stride(0), weight.data_ptr(), *weight.stride(),
                       offs.data_ptr(), offs.dtype == torch.int64, weight.shape[0], weight.shape[1],
                       weight.shape[2], output.data_ptr(), output.stride(0), torch.get_num_threads())
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
