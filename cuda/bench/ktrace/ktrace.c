// A CUPTI injection library: every kernel's start and end on the GPU, the kernels of CUDA
// graphs one by one, written as "start_ns,end_ns,name" lines to $KTRACE_OUT (default
// /tmp/ktrace.csv) when the process exits. For GPU machines without Nsight Systems: any CUDA
// program, unchanged, run with CUDA_INJECTION64_PATH pointing at the built library
// (trace_decode.sh builds and uses it).
//
//   gcc -shared -fPIC -O2 ktrace.c -I$CUDA/include -L$CUDA/lib64 -lcupti \
//       -DKREC=CUpti_ActivityKernel10 -o libktrace.so
//
// KREC: the kernel record of the CUPTI at hand (the highest CUpti_ActivityKernelN its
// cupti_activity.h declares); its start, end and name fields are what is read.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel10
#endif

static FILE* out;

static void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
    *size = 8 << 20;
    *buf = (uint8_t*)aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buf, size_t size,
                                      size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity* rec = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const KREC* k = (const KREC*)rec;
        fprintf(out, "%llu,%llu,%s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                k->name);
    }
    free(buf);
}

static void finish(void) {
    cuptiActivityFlushAll(1);
    fclose(out);
}

// Called by the CUDA driver when it loads the library (CUDA_INJECTION64_PATH).
int InitializeInjection(void) {
    const char* path = getenv("KTRACE_OUT");
    out = fopen(path ? path : "/tmp/ktrace.csv", "w");
    if (!out) {
        perror("ktrace: opening KTRACE_OUT");
        return 0;
    }
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    CUptiResult r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    if (r != CUPTI_SUCCESS) fprintf(stderr, "ktrace: cuptiActivityEnable failed (%d)\n", (int)r);
    atexit(finish);
    return 1;
}
