/*
 * growcache._frames: place fixed-layout TFRecord frames into batch rows in one pass.
 *
 * The vectorized reader's inner loop, for CPUs with a CRC32C instruction. Per call it reads
 * `count` consecutive frames of one shard from a file descriptor into a small scratch
 * buffer (so the data is still in the CPU cache when it is checked) and, per frame:
 *   - compares the 12-byte header and the Example's structure bytes with a template;
 *   - computes the record's CRC32C while copying each payload into its batch row, with
 *     non-temporal stores for large payloads (the rows are read by another process, or
 *     copied to a device, not by this CPU: caching them would only evict the input);
 *   - compares the CRC with the frame's footer.
 * Reading, checking and copying a byte thus costs one pass over it, where the numpy path
 * costs a kernel copy into the rows and a second pass for the CRC (measured on a 2-core
 * EPYC VM, 1 MiB records, two processes at once: 0.19-0.23 CPU s/GB against 0.22-0.31).
 *
 * The CRC is Mark Adler's three-stream hardware CRC32C (crc32c.c, zlib licence), with
 * the copy fused into its loops. The GIL is released for the whole call.
 *
 * Semantics are the numpy path's (growcache/vector_reader.py), which stays the reference
 * and the fallback where this module is not built, the CPU lacks SSE 4.2, or it is not
 * x86-64 (there the module holds only ACCELERATED = 0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GROWCACHE_X86 1
#include <immintrin.h>
#else
#define GROWCACHE_X86 0
#endif

#define HEADER_BYTES 12
#define FOOTER_BYTES 4
#define POLY 0x82f63b78u
#define LONG_BLOCK 8192
#define SHORT_BLOCK 256
/* Payload runs at least this long are stored past the CPU cache. */
#define STREAM_BYTES 4096

enum { PLACED = 0, BAD_HEADER = 1, BAD_CRC = 2, OTHER_LAYOUT = 3, SHRANK = 4 };

#if GROWCACHE_X86 /* elsewhere the module only says ACCELERATED = 0, and numpy reads */

/* ---- CRC32C stream shifts (Adler): tables to append LONG/SHORT zero bytes to a CRC ---- */

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that applies `len` zero bytes to a raw CRC state. */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32], row = 1;
    odd[0] = POLY;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* 2 zero bits */
    gf2_square(odd, even); /* 4 zero bits */
    do {                   /* odd: 4 bits on entry, squared to 1 byte, 2, 4, ... */
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_table(uint32_t zeros[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static uint32_t long_shift[4][256], short_shift[4][256];

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^
           zeros[3][crc >> 24];
}


/* Copy 16 bytes: past the cache when streaming (dst 16-byte aligned), else plainly. */
#define STORE16(dst, src, stream)                                                   \
    do {                                                                            \
        __m128i v_ = _mm_loadu_si128((const __m128i *)(src));                       \
        if (stream) _mm_stream_si128((__m128i *)(dst), v_);                         \
        else _mm_storeu_si128((__m128i *)(dst), v_);                                \
    } while (0)

/* Three interleaved CRC streams of `block` bytes each, copying as they go (dst may be NULL). */
#define CRC_BLOCKS(block, zeros)                                                    \
    while (len >= (block) * 3) {                                                    \
        uint64_t c1 = 0, c2 = 0;                                                    \
        const unsigned char *end = src + (block);                                   \
        do {                                                                        \
            c0 = _mm_crc32_u64(c0, *(const uint64_t *)src);                         \
            c1 = _mm_crc32_u64(c1, *(const uint64_t *)(src + (block)));             \
            c2 = _mm_crc32_u64(c2, *(const uint64_t *)(src + 2 * (block)));         \
            c0 = _mm_crc32_u64(c0, *(const uint64_t *)(src + 8));                   \
            c1 = _mm_crc32_u64(c1, *(const uint64_t *)(src + (block) + 8));         \
            c2 = _mm_crc32_u64(c2, *(const uint64_t *)(src + 2 * (block) + 8));     \
            if (dst) {                                                              \
                STORE16(dst, src, stream);                                          \
                STORE16(dst + (block), src + (block), stream);                      \
                STORE16(dst + 2 * (block), src + 2 * (block), stream);              \
                dst += 16;                                                          \
            }                                                                       \
            src += 16;                                                              \
        } while (src < end);                                                        \
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;                             \
        c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;                             \
        src += 2 * (block);                                                         \
        if (dst) dst += 2 * (block);                                                \
        len -= 3 * (block);                                                         \
    }

/*
 * Whether a forward copy from src to dst would stall on 4K aliasing: a store to dst + i
 * shares its low 12 address bits with the load of src + i + delta, which a forward loop
 * issues soon after, while the store is still pending (for streaming stores, long after).
 * Such copies run backwards, as glibc's memmove does. Measured, 1 MiB payloads, CPU s/GB
 * of the fused loop:
 *   - an earlier EPYC VM: 0.26 at delta 0 or past 2 KiB, 0.6 at delta 34, 0.8 at 98;
 *   - a Zen 4 EPYC VM: 0.40 at delta 0 through place() (a payload whose offset in the file
 *     matches its row's, modulo 4 KiB: every record of a frame that is a multiple of 4 KiB
 *     long); the fused pass alone, forced: 0.9-1.0 at 16-64, 0.11-0.13 from 192 on; the two
 *     passes cost 0.13-0.14 (benchmarks/fused_alignment.py measures a CPU).
 * Delta 0 counts as aliasing too: the two passes cost a third of the fused pass there.
 */
static inline int aliases_forward(const unsigned char *src, const unsigned char *dst) {
    size_t delta = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095;
    return delta < 2048;
}

/* Copy without a CRC: streamed past the cache, backwards where forwards would alias. */
static void copy_streamed(const unsigned char *src, unsigned char *dst, size_t len) {
    if (!aliases_forward(src, dst)) {
        while (len && ((uintptr_t)dst & 15)) {
            *dst++ = *src++;
            len--;
        }
        for (; len >= 16; len -= 16, src += 16, dst += 16) STORE16(dst, src, 1);
        memcpy(dst, src, len);
        return;
    }
    while (len && ((uintptr_t)(dst + len) & 15)) {
        len--;
        dst[len] = src[len];
    }
    for (; len >= 16; len -= 16) STORE16(dst + len - 16, src + len - 16, 1);
    memcpy(dst, src, len);
}

/*
 * Continue the raw (uninverted) CRC32C state `crc` over `len` bytes of `src`, copying them
 * to `dst` unless it is NULL; `stream`: store past the cache (for long runs).
 */
__attribute__((target("sse4.2"))) static uint32_t
crc_copy(uint32_t crc, const unsigned char *src, unsigned char *dst, size_t len, int stream) {
    if (dst && stream && aliases_forward(src, dst)) {
        /* The data is in the CPU cache (the scratch buffer): a second pass over it costs
         * less than the stalls of one fused forward pass. */
        uint32_t out = crc_copy(crc, src, NULL, len, 0);
        copy_streamed(src, dst, len);
        return out;
    }
    uint64_t c0 = crc;
    /* Streaming stores need 16-byte aligned destinations: align the head byte by byte. */
    while (len && dst && stream && ((uintptr_t)dst & 15)) {
        *dst++ = *src;
        c0 = _mm_crc32_u8((uint32_t)c0, *src++);
        len--;
    }
    CRC_BLOCKS(LONG_BLOCK, long_shift)
    CRC_BLOCKS(SHORT_BLOCK, short_shift)
    while (len >= 8) {
        c0 = _mm_crc32_u64(c0, *(const uint64_t *)src);
        if (dst) {
            memcpy(dst, src, 8);
            dst += 8;
        }
        src += 8;
        len -= 8;
    }
    while (len) {
        c0 = _mm_crc32_u8((uint32_t)c0, *src);
        if (dst) *dst++ = *src;
        src++;
        len--;
    }
    return (uint32_t)c0;
}

static void copy_only(const unsigned char *src, unsigned char *dst, size_t len, int stream) {
    if (stream) copy_streamed(src, dst, len);
    else memcpy(dst, src, len);
}

static int accelerated(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
}


static inline uint32_t mask_crc(uint32_t crc) {
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* ---- reading a shard through the scratch buffer ---- */

typedef struct {
    int fd;
    int64_t offset;         /* file offset of buffer[0] */
    int64_t end;            /* file offset where this call's frames end */
    unsigned char *buffer;
    size_t capacity, filled, at;
    int error;              /* errno of a failed read */
} Source;

/* At least one byte available at src->buffer + src->at, or 0 (shrank, or src->error). */
static size_t available(Source *src) {
    if (src->at < src->filled) return src->filled - src->at;
    src->offset += (int64_t)src->filled;
    src->filled = src->at = 0;
    int64_t want = src->end - src->offset;
    if (want <= 0) return 0;
    if ((size_t)want > src->capacity) want = (int64_t)src->capacity;
    for (;;) {
        ssize_t got = pread(src->fd, src->buffer, (size_t)want, (off_t)src->offset);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) src->error = errno;
        if (got <= 0) return 0;
        src->filled = (size_t)got;
        return src->filled;
    }
}

/* Fill `out` with the next `len` bytes; 0 if the file ended first. */
static int take(Source *src, unsigned char *out, size_t len) {
    while (len) {
        size_t n = available(src);
        if (!n) return 0;
        if (n > len) n = len;
        memcpy(out, src->buffer + src->at, n);
        src->at += n;
        out += n;
        len -= n;
    }
    return 1;
}

/*
 * One segment of a record: CRC it (when verifying) and copy it to `dst`, or compare it with
 * `expected` when dst is NULL. Returns 0 if the file ended first; sets *differs on a mismatch.
 */
static int segment(Source *src, size_t len, unsigned char *dst, const unsigned char *expected,
                   int verify, uint32_t *crc, int *differs) {
    int stream = len >= STREAM_BYTES;
    while (len) {
        size_t n = available(src);
        if (!n) return 0;
        if (n > len) n = len;
        const unsigned char *data = src->buffer + src->at;
        if (verify) *crc = crc_copy(*crc, data, dst, n, stream);
        else if (dst) copy_only(data, dst, n, stream);
        if (!dst && memcmp(data, expected, n)) *differs = 1;
        expected += n;
        if (dst) dst += n;
        src->at += n;
        len -= n;
    }
    return 1;
}

typedef struct {
    int64_t start, length, column; /* in the frame; column of `rows`, or -1: constant bytes */
} Segment;

static PyObject *place(PyObject *self, PyObject *args) {
    (void)self;
    int fd, verify;
    long long first_offset;
    Py_ssize_t count, columns;
    Py_buffer template_buf, segments_buf, rows_buf, scratch_buf;
    if (!PyArg_ParseTuple(args, "iLny*y*ny*w*p", &fd, &first_offset, &count, &template_buf,
                          &segments_buf, &columns, &rows_buf, &scratch_buf, &verify))
        return NULL;
    PyObject *result = NULL;
    const unsigned char *frame_template = template_buf.buf;
    size_t frame = (size_t)template_buf.len;
    const Segment *segments = segments_buf.buf;
    Py_ssize_t nsegments = segments_buf.len / (Py_ssize_t)sizeof(Segment);
    const uint64_t *rows = rows_buf.buf;
    /* Every product and sum below is checked before it is formed: a Python caller's plan
       (never the file's bytes, which are only compared with the template) could wrap them. */
    if (frame < HEADER_BYTES + FOOTER_BYTES || segments_buf.len % (Py_ssize_t)sizeof(Segment) ||
        count < 0 || columns < 0 || first_offset < 0 ||
        (columns && count > PY_SSIZE_T_MAX / 8 / columns) || rows_buf.len < count * columns * 8 ||
        (uint64_t)count > (uint64_t)(INT64_MAX - first_offset) / frame || scratch_buf.len < 1) {
        PyErr_SetString(PyExc_ValueError, "place(): inconsistent frame plan");
        goto done;
    }
    for (Py_ssize_t s = 0; s < nsegments; s++) {
        const Segment *seg = &segments[s];
        if (seg->start < HEADER_BYTES || seg->length < 0 || (size_t)seg->start > frame ||
            (size_t)seg->length > frame - (size_t)seg->start ||
            (size_t)(seg->start + seg->length) > frame - FOOTER_BYTES || seg->column >= columns) {
            PyErr_SetString(PyExc_ValueError, "place(): a segment lies outside the record");
            goto done;
        }
    }
    Source src = {fd, first_offset, first_offset + (int64_t)(count * frame), scratch_buf.buf,
                  (size_t)scratch_buf.len, 0, 0, 0};
    Py_ssize_t good = 0;
    int why = PLACED;
    Py_BEGIN_ALLOW_THREADS
    for (; good < count; good++) {
        unsigned char header[HEADER_BYTES], footer[FOOTER_BYTES];
        if (!take(&src, header, HEADER_BYTES)) { why = SHRANK; break; }
        if (memcmp(header, frame_template, HEADER_BYTES)) { why = BAD_HEADER; break; }
        uint32_t crc = 0xffffffffu;
        int differs = 0, ended = 0;
        for (Py_ssize_t s = 0; s < nsegments && !ended; s++) {
            const Segment *seg = &segments[s];
            unsigned char *dst = seg->column < 0 ? NULL
                                 : (unsigned char *)(uintptr_t)rows[good * columns + seg->column];
            ended = !segment(&src, (size_t)seg->length, dst, frame_template + seg->start, verify,
                             &crc, &differs);
        }
        if (ended || !take(&src, footer, FOOTER_BYTES)) { why = SHRANK; break; }
        uint32_t stored = (uint32_t)footer[0] | (uint32_t)footer[1] << 8 | (uint32_t)footer[2] << 16 |
                          (uint32_t)footer[3] << 24;
        if (verify && mask_crc(crc ^ 0xffffffffu) != stored) { why = BAD_CRC; break; }
        if (differs) { why = OTHER_LAYOUT; break; }
    }
    _mm_sfence(); /* streamed rows are visible before the batch is handed on */
    Py_END_ALLOW_THREADS
    if (why == SHRANK && src.error) {
        errno = src.error;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_BuildValue("ni", good, why);
done:
    PyBuffer_Release(&template_buf);
    PyBuffer_Release(&segments_buf);
    PyBuffer_Release(&rows_buf);
    PyBuffer_Release(&scratch_buf);
    return result;
}

#endif /* GROWCACHE_X86 */

static PyMethodDef methods[] = {
#if GROWCACHE_X86
    {"place", place, METH_VARARGS,
     "place(fd, offset, count, template, segments, columns, rows, scratch, verify) -> (placed, why)\n\n"
     "Read `count` frames of `len(template)` bytes from `offset`, check them against `template`\n"
     "(header and the constant segments) and, when `verify`, their CRC32C, and copy each\n"
     "payload segment to the address `rows[frame * columns + column]`. Stops at the first frame\n"
     "that is not placed; `why` says why: 0 all placed, 1 header differs, 2 CRC mismatch,\n"
     "3 constant bytes differ (another layout), 4 the file ended."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_frames", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__frames(void) {
    int fast = 0;
#if GROWCACHE_X86
    zeros_table(long_shift, LONG_BLOCK);
    zeros_table(short_shift, SHORT_BLOCK);
    fast = accelerated();
#endif
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "ACCELERATED", fast) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
