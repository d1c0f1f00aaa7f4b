# Included by compiled.pyx: rows that start on a cache line.
#
# numpy's allocator gives large arrays memory 16 bytes past a page's start: a 128-byte row
# (32 float32) then spans three cache lines, not two, and every row a lookup, an update or
# a delta touches costs half as much memory traffic again (a gather of 1.25M such rows from
# a 1.6 GB table: 31 ms against 23 ms aligned; an Adagrad-like read and add of 8,000:
# 0.70 ms against 0.29). Through numpy's allocator hooks (NEP 49), arrays made where
# :func:`aligned_allocations` was called start on a 64-byte boundary.
cimport numpy as cnp

cnp.import_array()

cdef extern from *:
    """
    #include <stdint.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/mman.h>

    #define PSTRAIN_ALIGN 64
    /* Huge pages asked for, as numpy's own allocator does, at and above this size. */
    #define PSTRAIN_HUGE (1u << 22)

    /* Each block is taken ALIGN bytes larger; its data starts at the first multiple of
       ALIGN past the block's start (1 to ALIGN bytes in), and the byte before the data
       says how far in it is. */
    static void *pstrain_place(char *base, size_t size) {
        if (base == NULL) return NULL;
        size_t shift = PSTRAIN_ALIGN - ((uintptr_t)base % PSTRAIN_ALIGN);
        base[shift - 1] = (char)shift;
    #ifdef MADV_HUGEPAGE
        if (size >= PSTRAIN_HUGE) {
            uintptr_t start = ((uintptr_t)base + 4095u) & ~(uintptr_t)4095u;
            uintptr_t end = ((uintptr_t)base + size + PSTRAIN_ALIGN) & ~(uintptr_t)4095u;
            if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
        }
    #endif
        return base + shift;
    }
    static void *pstrain_malloc(void *ctx, size_t size) {
        (void)ctx;
        if (size > SIZE_MAX - PSTRAIN_ALIGN) return NULL;
        return pstrain_place((char *)malloc(size + PSTRAIN_ALIGN), size);
    }
    static void *pstrain_calloc(void *ctx, size_t nelem, size_t elsize) {
        (void)ctx;
        if (elsize && nelem > (SIZE_MAX - PSTRAIN_ALIGN) / elsize) return NULL;
        /* calloc: a large block comes from fresh pages, zero without being written */
        return pstrain_place((char *)calloc(nelem * elsize + PSTRAIN_ALIGN, 1), nelem * elsize);
    }
    static void pstrain_free(void *ctx, void *ptr, size_t size) {
        (void)ctx; (void)size;
        if (ptr == NULL) return;
        free((char *)ptr - ((unsigned char *)ptr)[-1]);
    }
    static void *pstrain_realloc(void *ctx, void *ptr, size_t size) {
        if (ptr == NULL) return pstrain_malloc(ctx, size);
        if (size > SIZE_MAX - PSTRAIN_ALIGN) return NULL;
        size_t was = ((unsigned char *)ptr)[-1];
        char *base = (char *)realloc((char *)ptr - was, size + PSTRAIN_ALIGN);
        if (base == NULL) return NULL;  /* the old block stays as it was, as realloc's does */
        size_t shift = PSTRAIN_ALIGN - ((uintptr_t)base % PSTRAIN_ALIGN);
        /* the data moved with the block, `was` bytes in: both ranges lie inside it */
        if (shift != was) memmove(base + shift, base + was, size);
        base[shift - 1] = (char)shift;
        return base + shift;  /* (huge pages: a block moved by mremap keeps its advice) */
    }

    static PyDataMem_Handler pstrain_aligned_handler = {
        "pstrain_aligned_64", 1,
        {NULL, pstrain_malloc, pstrain_calloc, pstrain_realloc, pstrain_free}
    };
    static PyObject *pstrain_handler_capsule(void) {
        return PyCapsule_New(&pstrain_aligned_handler, "mem_handler", NULL);
    }
    """
    object pstrain_handler_capsule()

_ALIGNED = pstrain_handler_capsule()


def aligned_allocations():
    """Arrays made from now on in the current context (and in tasks and ``to_thread`` calls
    that copy it) start on a 64-byte boundary; returns the allocator that was in use."""
    return cnp.PyDataMem_SetHandler(_ALIGNED)
