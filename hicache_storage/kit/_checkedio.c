/* Checked page I/O: move a page between its buffers and a file and CRC32C it in one pass.
 *
 * A verified read in Python is a preadv of the whole page, then a CRC32C over it: a second pass
 * over bytes that no longer sit in the CPU cache, and with many pages in flight the memory's
 * bandwidth is what both passes share. Chunking the page in Python (read a chunk, checksum it
 * while it is cache-hot) returns to the interpreter twice a chunk, and sixteen threads handing
 * the GIL back and forth lose more than the cache saves. Here the whole loop, chunk after chunk,
 * runs without the GIL: each chunk is read with one preadv and checksummed while it is still in
 * the core's cache. Writes mirror it: each chunk is checksummed, then written from the cache.
 *
 * The CRC32C uses the SSE4.2 instruction on three independent streams at once (the instruction
 * has a latency of three cycles and a throughput of one) and joins them with tables that shift a
 * register past a stream's bytes; the module does not import where the instruction is missing,
 * and callers fall back to the `crc32c` package.
 *
 * read_files and write_files move a whole batch of pages, one file each, on threads of their
 * own: the caller's thread gives up the GIL once for the batch. A batch moved page by page from
 * Python threads takes the GIL back after every open, read and close, and each of those takes
 * it from the thread that launches the model's kernels (it hands the GIL over at every kernel it
 * launches): on the H200 a forward of an 8B model beside one such batch ran 16 times slower.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if !defined(__x86_64__) || !(defined(__GNUC__) || defined(__clang__))
#error "the checked reads need x86-64 and GCC or Clang; the Python fallback serves elsewhere"
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <nmmintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define HW __attribute__((target("sse4.2")))
#define STREAM 4096 /* bytes each of the three interleaved streams covers per round */
#define MAX_IOV 1024

static uint32_t shift_table[4][256]; /* register -> register after STREAM zero bytes */

HW static uint32_t
zeros(uint32_t reg, size_t count)
{
    uint64_t wide = reg;
    for (size_t i = 0; i < count / 8; i++) {
        wide = _mm_crc32_u64(wide, 0);
    }
    return (uint32_t)wide;
}

static void
init_shift_table(void)
{
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++) {
        basis[bit] = zeros(1u << bit, STREAM);
    }
    for (int part = 0; part < 4; part++) {
        for (int byte = 0; byte < 256; byte++) {
            uint32_t value = 0;
            for (int bit = 0; bit < 8; bit++) {
                if (byte >> bit & 1) {
                    value ^= basis[8 * part + bit];
                }
            }
            shift_table[part][byte] = value;
        }
    }
}

static inline uint32_t
shift(uint32_t reg)
{
    return shift_table[0][reg & 255] ^ shift_table[1][reg >> 8 & 255] ^
           shift_table[2][reg >> 16 & 255] ^ shift_table[3][reg >> 24];
}

static inline uint64_t
load64(const unsigned char *p)
{
    uint64_t value;
    memcpy(&value, p, 8);
    return value;
}

/* Continue the CRC32C register `reg` (not inverted) over `n` bytes at `p`. */
HW static uint32_t
update(uint32_t reg, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        reg = _mm_crc32_u8(reg, *p++);
        n--;
    }
    while (n >= 3 * STREAM) {
        uint64_t a = reg, b = 0, c = 0;
        for (const unsigned char *end = p + STREAM; p < end; p += 8) {
            a = _mm_crc32_u64(a, load64(p));
            b = _mm_crc32_u64(b, load64(p + STREAM));
            c = _mm_crc32_u64(c, load64(p + 2 * STREAM));
        }
        /* The register is linear in (state, bytes): joining runs is shifting and adding. */
        reg = shift(shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
        p += 2 * STREAM;
        n -= 3 * STREAM;
    }
    uint64_t wide = reg;
    for (; n >= 8; p += 8, n -= 8) {
        wide = _mm_crc32_u64(wide, load64(p));
    }
    reg = (uint32_t)wide;
    while (n--) {
        reg = _mm_crc32_u8(reg, *p++);
    }
    return reg;
}

static PyObject *
checked_crc32c(PyObject *module, PyObject *args)
{
    Py_buffer data;
    unsigned int value = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32c", &data, &value)) {
        return NULL;
    }
    uint32_t reg;
    Py_BEGIN_ALLOW_THREADS
    reg = update(~(uint32_t)value, data.buf, (size_t)data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~reg);
}

/* A tuple of the items of `seq` (a new reference), or NULL with TypeError(`message`) set.
 *
 * Every sequence an argument brings is copied this way, not walked in place: a list can change
 * while the call runs (another thread, or Python code a buffer export or __index__ runs), and
 * the copy keeps each item alive, and the count true, until the call returns. */
static PyObject *
snapshot(PyObject *seq, const char *message)
{
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_SetString(PyExc_TypeError, message);
    }
    return items;
}

/* Hold the contiguous buffers of a sequence (writable ones with `flags`); release_all frees. */
static int
hold_all(PyObject *seq, int flags, Py_buffer **held, Py_ssize_t *count)
{
    PyObject *fast = snapshot(seq, "buffers must be a sequence");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (PyObject_GetBuffer(item, &views[i], flags | PyBUF_C_CONTIGUOUS) < 0) {
            for (Py_ssize_t j = 0; j < i; j++) {
                PyBuffer_Release(&views[j]);
            }
            PyMem_Free(views);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *held = views;
    *count = n;
    return 0;
}

static void
release_all(Py_buffer *views, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
}

/* A position in a list of buffers: the next byte is views[index] at pos. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
    Py_ssize_t index;
    size_t pos;
} Cursor;

/* Describe up to `chunk` bytes from the cursor (not moving it) in `iov`; return the entries. */
static int
gather(const Cursor *at, size_t chunk, struct iovec *iov)
{
    int used = 0;
    size_t want = 0;
    Py_ssize_t index = at->index;
    size_t pos = at->pos;
    while (index < at->count && used < MAX_IOV && want < chunk) {
        size_t left = (size_t)at->views[index].len - pos;
        if (left == 0) {
            index++;
            pos = 0;
            continue;
        }
        size_t take = left < chunk - want ? left : chunk - want;
        iov[used].iov_base = (unsigned char *)at->views[index].buf + pos;
        iov[used].iov_len = take;
        used++;
        want += take;
        pos += take;
    }
    return used;
}

/* Move the cursor `bytes` forward. */
static void
advance(Cursor *at, size_t bytes)
{
    while (bytes && at->index < at->count) {
        size_t left = (size_t)at->views[at->index].len - at->pos;
        if (bytes >= left) {
            bytes -= left;
            at->index++;
            at->pos = 0;
        }
        else {
            at->pos += bytes;
            bytes = 0;
        }
    }
}

/* Let go of the buffers; return (bytes moved, CRC32C) or raise the OSError of `error`. */
static PyObject *
finish(Cursor *at, int error, size_t total, uint32_t reg)
{
    release_all(at->views, at->count);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("nk", (Py_ssize_t)total, (unsigned long)~reg);
}

/* Read from fd at offset into the cursor's buffers until they are full or the file ends,
 * chunk by chunk, continuing the CRC32C register *reg (not inverted) over the first `checked`
 * bytes; return 0 or an errno. */
HW static int
read_loop(int fd, Cursor *at, long long offset, size_t chunk, size_t checked, size_t *moved,
          uint32_t *crc)
{
    struct iovec iov[MAX_IOV];
    uint32_t reg = *crc;
    size_t total = 0;
    for (;;) {
        int used = gather(at, chunk, iov);
        if (used == 0) {
            break;
        }
        ssize_t got = preadv(fd, iov, used, (off_t)(offset + (long long)total));
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            return errno;
        }
        if (got == 0) {
            break;
        }
        size_t rest = (size_t)got;
        for (int i = 0; i < used && rest; i++) {
            size_t part = iov[i].iov_len < rest ? iov[i].iov_len : rest;
            if (total < checked) {
                size_t summed = checked - total < part ? checked - total : part;
                reg = update(reg, iov[i].iov_base, summed);
            }
            total += part;
            rest -= part;
        }
        advance(at, (size_t)got);
    }
    *moved = total;
    *crc = reg;
    return 0;
}

/* Write the cursor's buffers back to back to fd at offset, each chunk checksummed just before
 * it is written into the CRC32C register *crc (continued, as read_loop does); return 0 or an
 * errno. */
HW static int
write_loop(int fd, Cursor *at, long long offset, size_t chunk, size_t *moved, uint32_t *crc)
{
    struct iovec iov[MAX_IOV];
    uint32_t reg = *crc;
    size_t total = 0;
    for (;;) {
        int used = gather(at, chunk, iov);
        if (used == 0) {
            break;
        }
        size_t want = 0;
        for (int i = 0; i < used; i++) { /* checksummed now, written from the cache next */
            reg = update(reg, iov[i].iov_base, iov[i].iov_len);
            want += iov[i].iov_len;
        }
        advance(at, want);
        int first = 0;
        while (first < used) {
            ssize_t put = pwritev(fd, iov + first, used - first, (off_t)(offset + (long long)total));
            if (put < 0) {
                if (errno == EINTR) {
                    continue;
                }
                *moved = total;
                *crc = reg;
                return errno;
            }
            if (put == 0) {
                *moved = total;
                *crc = reg;
                return EIO;
            }
            total += (size_t)put;
            for (size_t rest = (size_t)put; rest && first < used;) {
                if (rest >= iov[first].iov_len) {
                    rest -= iov[first].iov_len;
                    first++;
                }
                else {
                    iov[first].iov_base = (unsigned char *)iov[first].iov_base + rest;
                    iov[first].iov_len -= rest;
                    rest = 0;
                }
            }
        }
    }
    *moved = total;
    *crc = reg;
    return 0;
}

static PyObject *
checked_read(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *seq;
    long long offset;
    Py_ssize_t chunk, checked;
    if (!PyArg_ParseTuple(args, "iOLnn:read_checked", &fd, &seq, &offset, &chunk, &checked)) {
        return NULL;
    }
    if (offset < 0 || chunk < 1 || checked < 0) {
        PyErr_SetString(PyExc_ValueError, "offset and checked must be >= 0 and chunk >= 1");
        return NULL;
    }
    Cursor at = {NULL, 0, 0, 0};
    if (hold_all(seq, PyBUF_WRITABLE, &at.views, &at.count) < 0) {
        return NULL;
    }
    size_t total = 0;
    uint32_t reg = ~(uint32_t)0;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = read_loop(fd, &at, offset, (size_t)chunk, (size_t)checked, &total, &reg);
    Py_END_ALLOW_THREADS
    return finish(&at, error, total, reg);
}

static PyObject *
checked_write(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *seq;
    long long offset;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "iOLn:write_checked", &fd, &seq, &offset, &chunk)) {
        return NULL;
    }
    if (offset < 0 || chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "offset must be >= 0 and chunk >= 1");
        return NULL;
    }
    Cursor at = {NULL, 0, 0, 0};
    if (hold_all(seq, 0, &at.views, &at.count) < 0) {
        return NULL;
    }
    size_t total = 0;
    uint32_t reg = ~(uint32_t)0;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = write_loop(fd, &at, offset, (size_t)chunk, &total, &reg);
    Py_END_ALLOW_THREADS
    return finish(&at, error, total, reg);
}

/* -- batches: one file per page, on threads of their own ------------------------------------ */

#define RECORD 32 /* the integrity record: magic | length u64 | crc32c u32 | digest u64 | gen u64 */
#define OUTCOME_KEPT 2 /* written, not published by link(): the temp file is left to the caller */
#define NOT_REGULAR -1 /* a read's size when its path names no regular file */

typedef struct {
    const char *path;  /* into a bytes object of the call's snapshot of the caller's paths */
    const char *temp;  /* writes: the temporary file published as path */
    Cursor at;
    size_t checked;    /* reads: bytes the CRC32C covers */
    uint64_t digest;   /* writes: the key digest of the record */
    int sealed;        /* writes: append a record */
    /* results */
    int error;
    long long stored;
    size_t moved;
    uint32_t crc;
    int outcome;
} Job;

/* read_runs / write_runs: one value moved through ranges of open files, in order, with one
 * CRC32C over it. */
typedef struct {
    int fd;
    long long offset;
    Cursor at;
} Range;

typedef struct {
    Range *ranges;
    Py_ssize_t count;
    size_t checked;    /* reads: bytes the CRC32C covers, from the first range on */
    /* results */
    int error;
    size_t moved;
    uint32_t crc;
} Run;

enum { READ_FILES, WRITE_FILES, READ_RUNS, WRITE_RUNS };

typedef struct {
    Job *jobs;
    Run *runs;
    Py_ssize_t count;
    atomic_long next;
    size_t chunk;
    int flags;   /* reads: open flags */
    int sync;    /* writes: fsync each file */
    int mode;
} Batch;

/* Whether an open() that failed with `error` met something that is not a regular file: a
 * socket or a device with no driver (ENXIO, ENODEV), or a directory opened for writing. */
static int
not_a_file(int error)
{
    return error == ENXIO || error == ENODEV || error == EISDIR;
}

/* Open `path` for reading without waiting on it: O_NONBLOCK keeps a FIFO with no writer (or a
 * device) from blocking open() beyond any deadline, and only a regular file is kept (blocking
 * again, its fstat in *info); -1 with *error an errno, or 0 when it names anything else. */
static int
open_regular(const char *path, int flags, struct stat *info, int *error)
{
    int fd = open(path, flags | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        *error = not_a_file(errno) ? 0 : errno;
        return -1;
    }
    if (fstat(fd, info) < 0) {
        *error = errno;
        close(fd);
        return -1;
    }
    if (!S_ISREG(info->st_mode)) {
        *error = 0;
        close(fd);
        return -1;
    }
    if (!(flags & O_NONBLOCK)) {
        int status = fcntl(fd, F_GETFL);
        if (status < 0 || fcntl(fd, F_SETFL, status & ~O_NONBLOCK) < 0) {
            *error = errno;
            close(fd);
            return -1;
        }
    }
    return fd;
}

static void
read_job(const Batch *batch, Job *job)
{
    int error = 0;
    struct stat info;
    int fd = open_regular(job->path, batch->flags, &info, &error);
    if (fd < 0) {
        job->error = error;
        job->stored = error ? 0 : NOT_REGULAR; /* not a regular file: a miss, never read */
        return;
    }
    size_t want = 0;
    for (Py_ssize_t i = 0; i < job->at.count; i++) {
        want += (size_t)job->at.views[i].len;
    }
    job->stored = (long long)info.st_size;
    if ((size_t)info.st_size == want) { /* another size is a miss: leave the page alone */
        uint32_t reg = ~(uint32_t)0;
        job->error = read_loop(fd, &job->at, 0, batch->chunk, job->checked, &job->moved, &reg);
        job->crc = ~reg;
    }
    close(fd);
}

static void
put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static int
seal_file(int fd, const Job *job)
{
    unsigned char record[RECORD];
    memcpy(record, "HCI1", 4);
    put_u64(record + 4, (uint64_t)job->moved);
    uint32_t crc = job->crc;
    for (int i = 0; i < 4; i++) {
        record[12 + i] = (unsigned char)(crc >> (8 * i));
    }
    put_u64(record + 16, job->digest);
    put_u64(record + 24, 0);
    for (;;) {
        ssize_t put = pwrite(fd, record, RECORD, (off_t)job->moved);
        if (put == RECORD) {
            return 0;
        }
        if (put < 0 && errno == EINTR) {
            continue;
        }
        return put < 0 ? errno : EIO;
    }
}

static int
no_link(int error)
{
    return error == EPERM || error == ENOTSUP || error == EOPNOTSUPP || error == EXDEV ||
           error == ENOSYS;
}

static void
write_job(const Batch *batch, Job *job)
{
    int fd = open(job->temp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) {
        job->error = errno;
        return;
    }
    uint32_t reg = ~(uint32_t)0;
    int error = write_loop(fd, &job->at, 0, batch->chunk, &job->moved, &reg);
    job->crc = ~reg;
    if (!error && job->sealed) {
        error = seal_file(fd, job);
    }
    if (!error && batch->sync && fsync(fd) < 0) {
        error = errno;
    }
    if (close(fd) < 0 && !error) {
        error = errno;
    }
    if (!error) {
        if (link(job->temp, job->path) == 0) {
            job->outcome = 1;
        }
        else if (errno == EEXIST) {
            struct stat info;
            if (stat(job->path, &info) < 0 || !S_ISREG(info.st_mode)) {
                /* Not a value (a FIFO, a directory, a dangling link): the caller replaces it. */
                job->outcome = OUTCOME_KEPT;
                return;
            }
            job->outcome = 0;
        }
        else if (no_link(errno)) {
            job->outcome = OUTCOME_KEPT; /* the caller publishes it another way */
            return;
        }
        else {
            error = errno;
        }
    }
    job->error = error;
    unlink(job->temp);
}

static void
read_run(const Batch *batch, Run *run)
{
    uint32_t reg = ~(uint32_t)0;
    size_t left = run->checked;
    for (Py_ssize_t i = 0; i < run->count; i++) {
        Range *range = &run->ranges[i];
        size_t want = 0, got = 0;
        for (Py_ssize_t j = 0; j < range->at.count; j++) {
            want += (size_t)range->at.views[j].len;
        }
        run->error = read_loop(range->fd, &range->at, range->offset, batch->chunk, left, &got,
                               &reg);
        run->moved += got;
        left = left > got ? left - got : 0;
        if (run->error || got < want) { /* failed, or the file ends first: the caller sees */
            break;
        }
    }
    run->crc = ~reg;
}

static void
write_run(const Batch *batch, Run *run)
{
    uint32_t reg = ~(uint32_t)0;
    for (Py_ssize_t i = 0; i < run->count; i++) {
        Range *range = &run->ranges[i];
        size_t put = 0;
        run->error = write_loop(range->fd, &range->at, range->offset, batch->chunk, &put, &reg);
        run->moved += put;
        if (run->error) {
            break;
        }
    }
    run->crc = ~reg;
}

static void *
work(void *arg)
{
    Batch *batch = arg;
    for (;;) {
        long i = atomic_fetch_add(&batch->next, 1);
        if (i >= batch->count) {
            return NULL;
        }
        if (batch->mode == WRITE_FILES) {
            write_job(batch, &batch->jobs[i]);
        }
        else if (batch->mode == READ_FILES) {
            read_job(batch, &batch->jobs[i]);
        }
        else if (batch->mode == READ_RUNS) {
            read_run(batch, &batch->runs[i]);
        }
        else {
            write_run(batch, &batch->runs[i]);
        }
    }
}

/* Run the batch on up to `threads` threads (the caller's among them); the GIL is not held. */
static void
run_batch(Batch *batch, int threads)
{
    if (threads > batch->count) {
        threads = (int)batch->count;
    }
    pthread_t ids[64];
    int started = 0;
    for (int i = 1; i < threads && started < 64; i++) {
        if (pthread_create(&ids[started], NULL, work, batch) != 0) {
            break; /* fewer threads: the others do the rest */
        }
        started++;
    }
    work(batch);
    for (int i = 0; i < started; i++) {
        pthread_join(ids[i], NULL);
    }
}

/* -1 with ValueError unless a batch's chunk size and thread count are >= 1. */
static int
check_batch(Py_ssize_t chunk, int threads)
{
    if (chunk < 1 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk and threads must be >= 1");
        return -1;
    }
    return 0;
}

/* Item i of `checked` as a byte count; -1 with an exception set if it is not one. */
static int
checked_size(PyObject *checked, Py_ssize_t i, size_t *out)
{
    Py_ssize_t value = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(checked, i));
    if (value < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "checked sizes must be >= 0");
        }
        return -1;
    }
    *out = (size_t)value;
    return 0;
}

static PyObject *
report_read(const Batch *batch, Py_ssize_t i)
{
    const Job *job = &batch->jobs[i];
    return Py_BuildValue("iLnk", job->error, job->stored, (Py_ssize_t)job->moved,
                         (unsigned long)job->crc);
}

static PyObject *
report_write(const Batch *batch, Py_ssize_t i)
{
    return Py_BuildValue("ii", batch->jobs[i].error, batch->jobs[i].outcome);
}

static PyObject *
report_run(const Batch *batch, Py_ssize_t i)
{
    const Run *run = &batch->runs[i];
    return Py_BuildValue("ink", run->error, (Py_ssize_t)run->moved, (unsigned long)run->crc);
}

/* Run `batch` without the GIL, then return the list of `report` of each of its items. */
static PyObject *
run_and_report(Batch *batch, int threads, PyObject *(*report)(const Batch *, Py_ssize_t))
{
    Py_BEGIN_ALLOW_THREADS
    run_batch(batch, threads);
    Py_END_ALLOW_THREADS
    PyObject *result = PyList_New(batch->count);
    for (Py_ssize_t i = 0; result != NULL && i < batch->count; i++) {
        PyObject *item = report(batch, i);
        if (item == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, item);
    }
    return result;
}

static void
free_jobs(Job *jobs, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (jobs[i].at.views != NULL) {
            release_all(jobs[i].at.views, jobs[i].at.count);
        }
    }
    PyMem_Free(jobs);
}

/* The string of `item` if it is a path the OS can take as it is: bytes without a NUL, which
 * open() would take for the end of the path and so name another file. Else NULL with
 * TypeError or ValueError set. */
static const char *
path_of(PyObject *item, const char *what)
{
    if (!PyBytes_Check(item)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes", what);
        return NULL;
    }
    if (strlen(PyBytes_AS_STRING(item)) != (size_t)PyBytes_GET_SIZE(item)) {
        PyErr_Format(PyExc_ValueError, "%s must not contain a NUL byte", what);
        return NULL;
    }
    return PyBytes_AS_STRING(item);
}

/* Fill jobs[i].path (and .temp) and hold each page's buffers; -1 with an exception set. */
static int
prepare(PyObject *paths, PyObject *temps, PyObject *pages, int flags, Job **out,
        Py_ssize_t *count)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths);
    if (PySequence_Fast_GET_SIZE(pages) != n ||
        (temps != NULL && PySequence_Fast_GET_SIZE(temps) != n)) {
        PyErr_SetString(PyExc_ValueError, "paths, temporary paths and pages must align");
        return -1;
    }
    Job *jobs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Job));
    if (jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* paths and temps are the call's tuples: they hold every string until it returns,
         * whatever the caller's lists become while the threads run without the GIL. */
        jobs[i].path = path_of(PySequence_Fast_GET_ITEM(paths, i), "paths");
        if (jobs[i].path == NULL) {
            free_jobs(jobs, i + 1);
            return -1;
        }
        if (temps != NULL) {
            jobs[i].temp = path_of(PySequence_Fast_GET_ITEM(temps, i), "temporary paths");
            if (jobs[i].temp == NULL) {
                free_jobs(jobs, i + 1);
                return -1;
            }
        }
        if (hold_all(PySequence_Fast_GET_ITEM(pages, i), flags, &jobs[i].at.views,
                     &jobs[i].at.count) < 0) {
            free_jobs(jobs, i + 1);
            return -1;
        }
    }
    *out = jobs;
    *count = n;
    return 0;
}

static PyObject *
files_read(PyObject *module, PyObject *args)
{
    PyObject *paths_arg, *pages_arg, *checked_arg;
    int flags, threads;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "OOOini:read_files", &paths_arg, &pages_arg, &checked_arg,
                          &flags, &chunk, &threads)) {
        return NULL;
    }
    if (check_batch(chunk, threads) < 0) {
        return NULL;
    }
    PyObject *paths = snapshot(paths_arg, "paths must be a sequence");
    PyObject *pages = paths ? snapshot(pages_arg, "pages must be a sequence") : NULL;
    PyObject *checked = pages ? snapshot(checked_arg, "checked must be a sequence") : NULL;
    PyObject *result = NULL;
    Job *jobs = NULL;
    Py_ssize_t n = 0;
    if (checked == NULL || prepare(paths, NULL, pages, PyBUF_WRITABLE, &jobs, &n) < 0) {
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(checked) != n) {
        PyErr_SetString(PyExc_ValueError, "checked must hold one size per page");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (checked_size(checked, i, &jobs[i].checked) < 0) {
            goto done;
        }
    }
    Batch batch = {jobs, NULL, n, 0, (size_t)chunk, flags, 0, READ_FILES};
    result = run_and_report(&batch, threads, report_read);
done:
    if (jobs != NULL) {
        free_jobs(jobs, n);
    }
    Py_XDECREF(checked);
    Py_XDECREF(pages);
    Py_XDECREF(paths);
    return result;
}

static PyObject *
files_write(PyObject *module, PyObject *args)
{
    PyObject *paths_arg, *temps_arg, *pages_arg, *digests_arg;
    int sync, threads;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "OOOOpni:write_files", &paths_arg, &temps_arg, &pages_arg,
                          &digests_arg, &sync, &chunk, &threads)) {
        return NULL;
    }
    if (check_batch(chunk, threads) < 0) {
        return NULL;
    }
    PyObject *paths = snapshot(paths_arg, "paths must be a sequence");
    PyObject *temps = paths ? snapshot(temps_arg, "temps must be a sequence") : NULL;
    PyObject *pages = temps ? snapshot(pages_arg, "pages must be a sequence") : NULL;
    PyObject *digests = NULL;
    PyObject *result = NULL;
    Job *jobs = NULL;
    Py_ssize_t n = 0;
    if (pages == NULL || prepare(paths, temps, pages, 0, &jobs, &n) < 0) {
        goto done;
    }
    if (digests_arg != Py_None) {
        digests = snapshot(digests_arg, "digests must be a sequence or None");
        if (digests == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(digests) != n) {
            PyErr_SetString(PyExc_ValueError, "digests must hold one key digest per page");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned long long value =
                PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(digests, i));
            if (value == (unsigned long long)-1 && PyErr_Occurred()) {
                goto done;
            }
            jobs[i].digest = (uint64_t)value;
            jobs[i].sealed = 1;
        }
    }
    Batch batch = {jobs, NULL, n, 0, (size_t)chunk, 0, sync, WRITE_FILES};
    result = run_and_report(&batch, threads, report_write);
done:
    if (jobs != NULL) {
        free_jobs(jobs, n);
    }
    Py_XDECREF(digests);
    Py_XDECREF(pages);
    Py_XDECREF(temps);
    Py_XDECREF(paths);
    return result;
}

static void
free_runs(Run *runs, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        for (Py_ssize_t j = 0; j < runs[i].count; j++) {
            if (runs[i].ranges[j].at.views != NULL) {
                release_all(runs[i].ranges[j].at.views, runs[i].ranges[j].at.count);
            }
        }
        PyMem_Free(runs[i].ranges);
    }
    PyMem_Free(runs);
}

/* Fill one run from a sequence of (fd, offset, buffers), holding the buffers with `flags`;
 * -1 with an exception set. */
static int
prepare_run(PyObject *spec, int flags, Run *run)
{
    PyObject *ranges = snapshot(spec, "a run is a sequence of (fd, offset, buffers)");
    if (ranges == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ranges);
    run->ranges = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Range));
    if (run->ranges == NULL) {
        Py_DECREF(ranges);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *buffers;
        Range *range = &run->ranges[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(ranges, i), "iLO:range", &range->fd,
                              &range->offset, &buffers)) {
            Py_DECREF(ranges);
            return -1;
        }
        if (range->offset < 0) {
            PyErr_SetString(PyExc_ValueError, "offsets must be >= 0");
            Py_DECREF(ranges);
            return -1;
        }
        if (hold_all(buffers, flags, &range->at.views, &range->at.count) < 0) {
            Py_DECREF(ranges);
            return -1;
        }
        run->count = i + 1;
    }
    Py_DECREF(ranges);
    return 0;
}

/* Read (mode READ_RUNS, with `checked_arg`) or write (WRITE_RUNS, NULL) each run of
 * `runs_arg` on up to `threads` threads, the GIL released; return the runs' reports. */
static PyObject *
move_runs(PyObject *runs_arg, PyObject *checked_arg, Py_ssize_t chunk, int threads, int mode)
{
    if (check_batch(chunk, threads) < 0) {
        return NULL;
    }
    PyObject *specs = snapshot(runs_arg, "runs must be a sequence");
    PyObject *checked = NULL;
    PyObject *result = NULL;
    Run *runs = NULL;
    Py_ssize_t n = 0;
    if (specs == NULL) {
        goto done;
    }
    if (checked_arg != NULL) {
        checked = snapshot(checked_arg, "checked must be a sequence");
        if (checked == NULL) {
            goto done;
        }
        if (PySequence_Fast_GET_SIZE(checked) != PySequence_Fast_GET_SIZE(specs)) {
            PyErr_SetString(PyExc_ValueError, "checked must hold one size per run");
            goto done;
        }
    }
    n = PySequence_Fast_GET_SIZE(specs);
    runs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Run));
    if (runs == NULL) {
        PyErr_NoMemory();
        n = 0;
        goto done;
    }
    int flags = mode == READ_RUNS ? PyBUF_WRITABLE : 0; /* reads fill the buffers */
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((checked != NULL && checked_size(checked, i, &runs[i].checked) < 0) ||
            prepare_run(PySequence_Fast_GET_ITEM(specs, i), flags, &runs[i]) < 0) {
            goto done;
        }
    }
    Batch batch = {NULL, runs, n, 0, (size_t)chunk, 0, 0, mode};
    result = run_and_report(&batch, threads, report_run);
done:
    if (runs != NULL) {
        free_runs(runs, n);
    }
    Py_XDECREF(checked);
    Py_XDECREF(specs);
    return result;
}

static PyObject *
runs_read(PyObject *module, PyObject *args)
{
    PyObject *runs_arg, *checked_arg;
    int threads;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "OOni:read_runs", &runs_arg, &checked_arg, &chunk, &threads)) {
        return NULL;
    }
    return move_runs(runs_arg, checked_arg, chunk, threads, READ_RUNS);
}

static PyObject *
runs_write(PyObject *module, PyObject *args)
{
    PyObject *runs_arg;
    int threads;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "Oni:write_runs", &runs_arg, &chunk, &threads)) {
        return NULL;
    }
    return move_runs(runs_arg, NULL, chunk, threads, WRITE_RUNS);
}

static PyMethodDef methods[] = {
    {"crc32c", checked_crc32c, METH_VARARGS,
     "crc32c(data, value=0) -> int: the CRC32C of data, continued from value."},
    {"read_checked", checked_read, METH_VARARGS,
     "read_checked(fd, buffers, offset, chunk, checked) -> (bytes read, crc32c)\n\n"
     "Fill buffers in order from fd at offset, at most chunk bytes per preadv, and return the\n"
     "bytes read (short at end of file) and the CRC32C of the first `checked` of them, each\n"
     "chunk checksummed right after it was read. The GIL is released throughout."},
    {"write_checked", checked_write, METH_VARARGS,
     "write_checked(fd, buffers, offset, chunk) -> (bytes written, crc32c)\n\n"
     "Write buffers back to back to fd at offset, at most chunk bytes per pwritev, each chunk\n"
     "checksummed just before it is written (so the write reads it from the cache); raise\n"
     "OSError if a write fails. The GIL is released throughout."},
    {"read_files", files_read, METH_VARARGS,
     "read_files(paths, pages, checked, flags, chunk, threads) -> [(errno, size, read, crc32c)]\n\n"
     "For each page: open its path (bytes) with flags, and when the file's size is the page's\n"
     "(the sum of its buffers) fill the buffers from it, checksumming the first checked[i]\n"
     "bytes; up to `threads` pages at once, the GIL released for the whole batch. A page\n"
     "whose file failed has its errno; one of another size has read 0 and is left untouched;\n"
     "a path that names no regular file (a FIFO, a directory, a socket, a device) has size -1\n"
     "and is never read, nor waited on. A path holding a NUL byte raises ValueError."},
    {"write_files", files_write, METH_VARARGS,
     "write_files(paths, temps, pages, digests, fsync, chunk, threads) -> [(errno, outcome)]\n\n"
     "For each page: write its buffers to a new file at temps[i] (and, with digests, the\n"
     "32-byte integrity record of key digest digests[i]), fsync it if asked, link it to\n"
     "paths[i] and remove the temporary file. outcome is 1 if this call published the page,\n"
     "0 if paths[i] held a value, 2 if the filesystem cannot hard-link or paths[i] names no\n"
     "regular file (the temporary file is left for the caller to publish). Up to `threads`\n"
     "pages at once, the GIL released throughout. A path holding a NUL raises ValueError."},
    {"read_runs", runs_read, METH_VARARGS,
     "read_runs(runs, checked, chunk, threads) -> [(errno, read, crc32c)]\n\n"
     "Each run is a sequence of (fd, offset, buffers): one value read from ranges of open\n"
     "files in order, the CRC32C continued across them over its first checked[i] bytes. Up\n"
     "to `threads` runs at once, the GIL released for the whole batch. A run stops at its\n"
     "first failed or short range (read says how far it got)."},
    {"write_runs", runs_write, METH_VARARGS,
     "write_runs(runs, chunk, threads) -> [(errno, written, crc32c)]\n\n"
     "Each run is a sequence of (fd, offset, buffers): one value written to ranges of open\n"
     "files in order, each chunk checksummed just before it is written, the CRC32C continued\n"
     "across the run. Up to `threads` runs at once, the GIL released for the whole batch. A\n"
     "run stops at its first failed range (written says how far it got)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_checkedio",
    .m_doc = "Checked page I/O: preadv/pwritev and CRC32C in one pass, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__checkedio(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) {
        PyErr_SetString(PyExc_ImportError, "this CPU has no SSE4.2 CRC32 instruction");
        return NULL;
    }
    init_shift_table();
    return PyModule_Create(&module_def);
}
