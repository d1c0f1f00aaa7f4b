# Included by compiled.pyx: reads of records from disk, through io_uring where the kernel has it.

from libc.errno cimport EAGAIN, EBUSY, errno
from posix.unistd cimport pread


#: A read of records from disk reads past dead records between live ones up to this many
#: bytes apart, in spans of at most ``READ_SPAN`` bytes (see :func:`pread_records`).
DEF READ_GAP = 16384
DEF READ_SPAN = 1 << 20


# -- reads of records through io_uring --------------------------------------------------------
# A tiered table's rows come back from disk as hundreds of small reads a request. One
# ``pread`` at a time waits for each in turn, and on a virtual disk each read that misses
# the page cache costs 25 to 30 µs of CPU (65 µs wall) on its own; submitted together
# through io_uring they cost about 3 µs each (9 µs wall: the disk serves them in
# parallel); those in the page cache cost about 1 µs either way (measured here, a 2 GB
# file, 288-byte records). The ring is the kernel's own interface (no liburing):
# one per thread that reads (rings are not shared between threads), made at its first
# read and closed when the thread ends. Where the kernel has none (before Linux 5.6, a
# sandbox that forbids it, ``kernel.io_uring_disabled``) or ``PSTRAIN_IO_URING=0``, the
# reads are ``pread`` calls, as before.
cdef extern from *:
    """
    #include <errno.h>
    #include <pthread.h>
    #include <sys/mman.h>
    #include <sys/syscall.h>
    #include <sys/uio.h>
    #include <unistd.h>
    #ifndef RWF_NOWAIT
    #define RWF_NOWAIT 0x00000008
    #endif
    #if defined(__linux__) && __has_include(<linux/io_uring.h>) && defined(__NR_io_uring_setup)
    #include <linux/io_uring.h>
    #endif
    /* IORING_OP_READ came with Linux 5.6, as did this feature flag (headers and kernel) */
    #if defined(__linux__) && defined(__NR_io_uring_setup) && defined(IORING_FEAT_RW_CUR_POS)
    #define PST_URING 1
    #else
    #define PST_URING 0
    #endif

    /* Reads a ring keeps in flight at once (its submission queue's size). */
    #define PST_RING_ENTRIES 128
    /* Times a submission the kernel has no memory for (EAGAIN) is tried before the reads
       are left to pread. */
    #define PST_BUSY_TRIES 10000
    /* The most bytes one read asks for (a longer run of records is read in pieces). */
    #define PST_MAX_READ (1 << 26)

    #if PST_URING
    typedef struct {
        int fd;
        unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask, entries;
        struct io_uring_sqe *sqes;
        struct io_uring_cqe *cqes;
        void *sq_map, *cq_map;
        size_t sq_len, cq_len, sqes_len;
        unsigned generation;
    } pst_ring;

    static pthread_key_t pst_ring_key;
    static pthread_once_t pst_ring_once = PTHREAD_ONCE_INIT;
    static int pst_ring_key_ok = 0;
    /* 1: rings work here; -1: they do not (every read a pread from then on); 0: not known yet */
    static volatile int pst_uring_state = 0;

    static void pst_ring_close(void *p) {
        pst_ring *r = (pst_ring *)p;
        if (r == NULL) return;
        munmap(r->sqes, r->sqes_len);
        munmap(r->cq_map, r->cq_len);
        munmap(r->sq_map, r->sq_len);
        close(r->fd);
        free(r);
    }

    /* A forked child's generation: a ring made before the fork is its parent's too. */
    static volatile unsigned pst_ring_generation = 0;

    static void pst_ring_forked(void) { pst_ring_generation++; }

    static void pst_ring_key_make(void) {
        pst_ring_key_ok = pthread_key_create(&pst_ring_key, pst_ring_close) == 0
                          && pthread_atfork(NULL, NULL, pst_ring_forked) == 0;
    }

    /* This thread's ring, made at its first use; NULL where rings cannot be had. */
    static pst_ring *pst_ring_get(void) {
        struct io_uring_params p;
        pst_ring *r;
        if (pst_uring_state < 0) return NULL;
        pthread_once(&pst_ring_once, pst_ring_key_make);
        if (!pst_ring_key_ok) { pst_uring_state = -1; return NULL; }
        r = (pst_ring *)pthread_getspecific(pst_ring_key);
        if (r != NULL && r->generation == pst_ring_generation) return r;
        if (r != NULL) {  /* this process forked since: the child leaves its parent's ring */
            pthread_setspecific(pst_ring_key, NULL);
            pst_ring_close(r);
        }
        r = (pst_ring *)calloc(1, sizeof(pst_ring));
        if (r == NULL) return NULL;
        memset(&p, 0, sizeof p);
        r->fd = (int)syscall(__NR_io_uring_setup, PST_RING_ENTRIES, &p);
        if (r->fd < 0) {
            /* no rings here (ENOSYS, EPERM, ...); ENOMEM or EMFILE may pass: try again later */
            if (errno != ENOMEM && errno != EMFILE && errno != ENFILE) pst_uring_state = -1;
            free(r);
            return NULL;
        }
        if (!(p.features & IORING_FEAT_RW_CUR_POS)) {  /* a kernel before 5.6: no IORING_OP_READ */
            close(r->fd);
            free(r);
            pst_uring_state = -1;
            return NULL;
        }
        r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
        r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
        r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
        r->sq_map = mmap(0, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
        r->cq_map = mmap(0, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
        r->sqes = (struct io_uring_sqe *)mmap(0, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
        if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
            if (r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_len);
            if (r->cq_map != MAP_FAILED) munmap(r->cq_map, r->cq_len);
            if (r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
            close(r->fd);
            free(r);
            return NULL;
        }
        r->entries = p.sq_entries;
        r->generation = pst_ring_generation;
        r->sq_tail = (unsigned *)((char *)r->sq_map + p.sq_off.tail);
        r->sq_mask = (unsigned *)((char *)r->sq_map + p.sq_off.ring_mask);
        r->sq_array = (unsigned *)((char *)r->sq_map + p.sq_off.array);
        r->cq_head = (unsigned *)((char *)r->cq_map + p.cq_off.head);
        r->cq_tail = (unsigned *)((char *)r->cq_map + p.cq_off.tail);
        r->cq_mask = (unsigned *)((char *)r->cq_map + p.cq_off.ring_mask);
        r->cqes = (struct io_uring_cqe *)((char *)r->cq_map + p.cq_off.cqes);
        if (pthread_setspecific(pst_ring_key, r) != 0) { pst_ring_close(r); return NULL; }
        pst_uring_state = 1;
        return r;
    }

    /* The rest of a read the ring did not finish (a short read), by pread: 0, an errno or
       -1 (the file ends first). */
    static int pst_finish_read(int fd, char *buf, size_t want, int64_t at) {
        while (want > 0) {
            ssize_t got = pread(fd, buf, want, at);
            if (got < 0) { if (errno == EINTR) continue; return errno; }
            if (got == 0) return -1;
            buf += got; want -= (size_t)got; at += got;
        }
        return 0;
    }

    /* Records ``records[0:n]`` (ascending) of ``width`` bytes of file ``fd``, the first at
       byte ``offset``, into ``out`` (``n`` rows of ``width``): a read per run of neighbouring
       records, up to PST_RING_ENTRIES of them in flight. Returns 0, an errno, -1 for a short
       read (the file holds fewer records), or -2: no ring here (nothing was read). Every
       read submitted has completed when it returns, whatever it returns. With ``missed``
       (a byte a record), only what the page cache holds is read (RWF_NOWAIT: the kernel
       fails a read that would wait for the disk rather than hand it to its workers): the
       records of a run not read whole are marked there, and no read's failure is an error
       (a blocking read of those records reports it). */
    static int pst_uring_records(int fd, const int64_t *records, Py_ssize_t n, Py_ssize_t width,
                                 uint8_t *out, int64_t offset, uint8_t *missed) {
        pst_ring *r = pst_ring_get();
        Py_ssize_t i = 0, j, in_flight = 0;
        int err = 0;
        if (r == NULL) return -2;
        while (i < n || in_flight > 0) {
            unsigned tail = *r->sq_tail;
            Py_ssize_t queued = 0, sent = 0;
            while (err == 0 && i < n && in_flight + queued < (Py_ssize_t)r->entries) {
                unsigned k = (tail + (unsigned)queued) & *r->sq_mask;
                struct io_uring_sqe *sqe = &r->sqes[k];
                j = i + 1;
                while (j < n && records[j] == records[j - 1] + 1 && (j + 1 - i) * width <= PST_MAX_READ
                       && j - i < 0xFFFFFF)
                    j++;
                memset(sqe, 0, sizeof *sqe);
                sqe->opcode = IORING_OP_READ;
                sqe->fd = fd;
                sqe->addr = (uint64_t)(uintptr_t)(out + i * width);
                sqe->len = (uint32_t)((j - i) * width);
                sqe->off = (uint64_t)(offset + records[i] * width);
                sqe->rw_flags = missed != NULL ? RWF_NOWAIT : 0;
                sqe->user_data = ((uint64_t)i << 24) | (uint64_t)(j - i);
                r->sq_array[k] = k;
                queued++;
                i = j;
            }
            if (queued == 0 && in_flight == 0) break;  /* (an error stopped the submissions) */
            if (queued) __atomic_store_n(r->sq_tail, tail + (unsigned)queued, __ATOMIC_RELEASE);
            for (int busy = 0;;) {  /* submit what is queued and wait for a completion at least */
                long got = syscall(__NR_io_uring_enter, r->fd, (unsigned)(queued - sent), 1u,
                                   IORING_ENTER_GETEVENTS, NULL, 0);
                if (got >= 0) {
                    sent += got;
                    if (sent >= queued) break;
                    continue;
                }
                if (errno == EINTR) continue;
                /* the kernel short of memory for the requests: a while, then refuse */
                if ((errno == EAGAIN || errno == EBUSY) && ++busy < PST_BUSY_TRIES) continue;
                if (err == 0) err = errno;  /* the ring refuses: what it took completes below */
                if (sent < queued) __atomic_store_n(r->sq_tail, tail + (unsigned)sent, __ATOMIC_RELEASE);
                break;
            }
            in_flight += sent;
            if (in_flight == 0) break;
            {
                unsigned head = *r->cq_head;
                unsigned ctail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
                while (head != ctail) {
                    struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
                    Py_ssize_t first = (Py_ssize_t)(cqe->user_data >> 24);
                    Py_ssize_t count = (Py_ssize_t)(cqe->user_data & 0xFFFFFF);
                    size_t want = (size_t)(count * width);
                    int res = cqe->res;
                    head++;
                    in_flight--;
                    if (err) continue;
                    if (missed != NULL) {  /* not all of it in the page cache: read it blocking later */
                        if (res < 0 || (size_t)res < want) memset(missed + first, 1, (size_t)count);
                        continue;
                    }
                    if (res < 0) err = -res;
                    else if ((size_t)res < want)
                        err = pst_finish_read(fd, (char *)(out + first * width) + res, want - (size_t)res,
                                              offset + records[first] * width + res);
                }
                __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
            }
        }
        return err;
    }
    #else
    static volatile int pst_uring_state = -1;
    static int pst_uring_records(int fd, const int64_t *records, Py_ssize_t n, Py_ssize_t width,
                                 uint8_t *out, int64_t offset, uint8_t *missed) { return -2; }
    #endif

    /* :func:`pread_records` of what the page cache holds (``missed`` marks the rest): through
       the ring if ``uring`` and there is one, else a ``preadv2`` with RWF_NOWAIT a run (a
       kernel or file system without it: every record missed). */
    static void pst_cached_records(int fd, const int64_t *records, Py_ssize_t n, Py_ssize_t width,
                                   uint8_t *out, int64_t offset, uint8_t *missed, int uring) {
        Py_ssize_t i = 0, j;
        if (uring) {
            int err = pst_uring_records(fd, records, n, width, out, offset, missed);
            if (err == 0) return;
            if (err != -2 && err != EAGAIN && err != EBUSY) {  /* the ring refused: all of it later */
                memset(missed, 1, (size_t)n);
                return;
            }
            memset(missed, 0, (size_t)n);  /* (no ring, or one short of memory: all read again) */
        }
        while (i < n) {
            struct iovec v;
            ssize_t got;
            j = i + 1;
            while (j < n && records[j] == records[j - 1] + 1) j++;
            v.iov_base = out + i * width;
            v.iov_len = (size_t)((j - i) * width);
            do {
                got = preadv2(fd, &v, 1, offset + records[i] * width, RWF_NOWAIT);
            } while (got < 0 && errno == EINTR);
            if (got < 0 || (size_t)got < v.iov_len) memset(missed + i, 1, (size_t)(j - i));
            i = j;
        }
    }
    """
    int pst_uring_records(int fd, const int64_t* records, Py_ssize_t n, Py_ssize_t width, uint8_t* out, int64_t offset, uint8_t* missed) nogil
    void pst_cached_records(int fd, const int64_t* records, Py_ssize_t n, Py_ssize_t width, uint8_t* out, int64_t offset, uint8_t* missed, int uring) nogil
    int pst_uring_state

import os as _os

#: Whether this process reads records through io_uring where the kernel has it (the
#: ``PSTRAIN_IO_URING`` variable: ``0`` turns it off).
_URING = _os.environ.get("PSTRAIN_IO_URING", "1") != "0"


def io_uring_reads():
    """Whether record reads (:func:`pread_records`) have gone through io_uring in this
    process: True once a ring worked, False once one could not be made (or
    ``PSTRAIN_IO_URING=0``), None before the first read."""
    if not _URING or pst_uring_state < 0:
        return False
    return True if pst_uring_state > 0 else None


def cached_records(
    int fd,
    const int64_t[::1] records,
    Py_ssize_t width,
    uint8_t[:, ::1] out,
    uint8_t[::1] missed,
    int64_t offset=0,
    bint uring=True,
):
    """:func:`pread_records` of the records the page cache holds, never waiting for the
    disk (RWF_NOWAIT; through io_uring where there is a ring and ``uring``, else by
    ``preadv2``): a run of neighbouring records not read whole has each of its records
    marked 1 in ``missed`` (which is set for every record first), and its rows of ``out``
    are not to be used (a read that stopped short filled some). What a tiered table reads
    on its serving loop before it hands the rest to a thread. Returns how many records
    were read; a failed read is only missed (the blocking read of those records reports
    it)."""
    cdef Py_ssize_t n = records.shape[0], k, read = 0
    cdef int use_ring = 1 if (uring and _URING) else 0
    if out.shape[0] < n or out.shape[1] != width:
        raise ValueError("cached_records: out must be (records, width)")
    if missed.shape[0] < n:
        raise ValueError("cached_records: missed must hold a byte a record")
    if offset < 0:
        raise ValueError("cached_records: offset must be at least 0")
    if n == 0:
        return 0
    with nogil:
        memset(&missed[0], 0, n)
        pst_cached_records(fd, &records[0], n, width, &out[0, 0], offset, &missed[0], use_ring)
        for k in range(n):
            read += missed[k] == 0
    return read


def pread_records(
    int fd,
    const int64_t[::1] records,
    Py_ssize_t width,
    uint8_t[:, ::1] out,
    int64_t offset=0,
    bint uring=True,
):
    """Records ``records`` (ascending) of ``width`` bytes each of the file ``fd``, the first at
    byte ``offset`` (a column of a checkpoint file linked into a tier), into the rows of
    ``out``, without the GIL (a tiered table's rows read from disk). Through io_uring where
    the kernel has it (and ``uring``): a read per run of neighbouring records, many in
    flight at once (see above). Else by ``pread``: a run of neighbouring records is one
    call into ``out``; records a few apart (gaps of at most ``READ_GAP`` bytes) are read in
    one call of the span that holds them (at most ``READ_SPAN`` bytes, into a buffer of that
    size) and copied out: a call costs about what copying a few KiB does, so reading the
    dead records between live ones is cheaper than a call each. Returns 0, the errno of a
    failed read, or -1 for a short one (a file that holds fewer records than asked)."""
    cdef Py_ssize_t i = 0, j, k, n = records.shape[0]
    cdef ssize_t got, want
    cdef int64_t first
    cdef int err = 0
    cdef uint8_t *span = NULL
    if out.shape[0] < n or out.shape[1] != width:
        raise ValueError("pread_records: out must be (records, width)")
    if offset < 0:
        raise ValueError("pread_records: offset must be at least 0")
    if n == 0:
        return 0
    if uring and _URING:
        with nogil:
            err = pst_uring_records(fd, &records[0], n, width, &out[0, 0], offset, NULL)
        if err != -2 and err != EAGAIN and err != EBUSY:
            return err
        err = 0  # no ring here, or one the kernel had no memory for: the same reads by pread
    if width <= READ_SPAN:
        span = <uint8_t *>malloc(READ_SPAN)
        if span == NULL:
            raise MemoryError("pread_records: no memory for its read buffer")
    with nogil:
        while i < n:
            first = records[i]
            j = i + 1
            while j < n and records[j] == records[j - 1] + 1:
                j += 1
            if span != NULL:
                while (
                    j < n
                    and (records[j] - records[j - 1] - 1) * width <= READ_GAP
                    and (records[j] - first + 1) * width <= READ_SPAN
                ):
                    j += 1
            want = (records[j - 1] - first + 1) * width
            if want == (j - i) * width:  # neighbours only: straight into out
                got = pread(fd, &out[i, 0], want, offset + first * width)
            else:
                got = pread(fd, span, want, offset + first * width)
                if got == want:
                    for k in range(i, j):
                        memcpy(&out[k, 0], span + (records[k] - first) * width, width)
            if got != want:
                err = errno if got < 0 else -1
                break
            i = j
    free(span)
    return err
