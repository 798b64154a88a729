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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if !defined(__x86_64__) || !(defined(__GNUC__) || defined(__clang__))
#error "the checked reads need x86-64 and GCC or Clang; the Python fallback serves elsewhere"
#endif

#include <errno.h>
#include <limits.h>
#include <nmmintrin.h>
#include <stdint.h>
#include <string.h>
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

/* Hold the contiguous buffers of a sequence (writable ones with `flags`); release_all frees. */
static int
hold_all(PyObject *seq, int flags, Py_buffer **held, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, "buffers must be a sequence");
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
    struct iovec iov[MAX_IOV];
    uint32_t reg = ~(uint32_t)0;
    size_t total = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int used = gather(&at, (size_t)chunk, iov);
        if (used == 0) {
            break;
        }
        ssize_t got = preadv(fd, iov, used, (off_t)(offset + (long long)total));
        if (got < 0) {
            if (errno == EINTR) {
                continue;
            }
            error = errno;
            break;
        }
        if (got == 0) {
            break;
        }
        size_t rest = (size_t)got;
        for (int i = 0; i < used && rest; i++) {
            size_t part = iov[i].iov_len < rest ? iov[i].iov_len : rest;
            if (total < (size_t)checked) {
                size_t summed = (size_t)checked - total < part ? (size_t)checked - total : part;
                reg = update(reg, iov[i].iov_base, summed);
            }
            total += part;
            rest -= part;
        }
        advance(&at, (size_t)got);
    }
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
    struct iovec iov[MAX_IOV];
    uint32_t reg = ~(uint32_t)0;
    size_t total = 0;
    int error = 0;
    Py_BEGIN_ALLOW_THREADS
    while (!error) {
        int used = gather(&at, (size_t)chunk, iov);
        if (used == 0) {
            break;
        }
        size_t want = 0;
        for (int i = 0; i < used; i++) { /* checksummed now, written from the cache next */
            reg = update(reg, iov[i].iov_base, iov[i].iov_len);
            want += iov[i].iov_len;
        }
        advance(&at, want);
        int first = 0;
        while (first < used) {
            ssize_t put = pwritev(fd, iov + first, used - first, (off_t)(offset + (long long)total));
            if (put < 0) {
                if (errno == EINTR) {
                    continue;
                }
                error = errno;
                break;
            }
            if (put == 0) {
                error = EIO;
                break;
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
    Py_END_ALLOW_THREADS
    return finish(&at, error, total, reg);
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
