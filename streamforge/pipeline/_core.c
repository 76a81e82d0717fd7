/* streamforge.pipeline._core: the compiled core of the per-batch hot loops.
 *
 * Functions on raw buffers seen through the buffer protocol (numpy arrays in
 * practice; no numpy headers are needed to build this):
 *
 *   expand(tokens, lookahead, start, length, stream, continues, document,
 *          input_ids, labels, position_ids, doc_ids, source_ids) -> bool
 *       Fills the batch contract's tensors of a RowBatch (streamforge/pipeline/batch.py) in
 *       one pass over the batch: each output is a C-contiguous array of R*T items (int64 for
 *       input_ids, labels and position_ids, int32 for doc_ids and source_ids) or None when
 *       not wanted. Returns False, having written nothing, for a layout it does not take
 *       (pieces empty, out of order, overlapping or outside the batch; odd dtypes or
 *       strides), so that the caller runs the numpy reference instead; on the layouts it
 *       takes, the values are those of the numpy path, bit for bit.
 *
 *   fill_rows(parts, tokens, offset) -> int or None
 *       Writes the 1-D arrays of ``parts``, laid end to end, into the [R, T+1] token grid
 *       ``tokens`` from position ``offset`` of its flattened first T columns (rows wrap,
 *       column T is left alone) and returns the number of tokens written; None, having
 *       written nothing, where a part's dtype differs from the grid's or a part is not a
 *       contiguous 1-D array. ValueError where the parts run past the grid.
 *
 *   fill_parts(source, starts, lengths, tokens, offset) -> int or None
 *       As ``fill_rows`` with the parts given as spans of one 1-D array: ``source[starts[k]
 *       : starts[k] + lengths[k]]`` for each k, laid end to end (the balanced packer's
 *       window, whose parts are spans of the tokens it took). None, having written nothing,
 *       where ``source`` is not a contiguous 1-D array of the grid's dtype; ValueError where
 *       a span lies outside ``source`` or the parts run past the grid.
 *
 *   fill_window(frames, doc_frame, doc_start, doc_len, eos, pos, offset, size, tokens, filled)
 *           -> int or None
 *       As ``fill_rows`` with the parts read straight from a shuffle window's decoded frames
 *       (stages/window.py): document d is ``doc_len[d]`` tokens from byte ``doc_start[d]`` of
 *       ``frames[doc_frame[d]]``, followed by the token ``eos`` where eos >= 0. Writes the
 *       ``size`` tokens of the documents laid end to end from token ``offset`` of document
 *       ``pos`` on, into the grid from flat position ``filled``; returns the tokens written.
 *       No object per document: one buffer per frame touched. None, having written nothing,
 *       where a frame has no contiguous buffer; ValueError where a document lies outside its
 *       frame, the run outside the window or past the grid.
 *
 *   window_block(frames, doc_frame, doc_start, doc_len, eos, pos, offset, stream, shard, record, tokens,
 *                columns, shard32, stream16, continues) -> True or None
 *       A whole batch from one shuffle window in one call (stages/window.py, ``Window.block``):
 *       the R*T tokens from token ``offset`` of document ``pos`` on, written into the [R, T+1]
 *       grid ``tokens`` as fill_window writes them, then column T of each row (the next row's
 *       first token, and after the last row the window's token after the batch); and the
 *       RowBatch columns of its D pieces, one a document touched: ``columns`` (4*D int64:
 *       start, length, record, token_start), ``shard32`` (int32), ``stream16`` (int16, all
 *       ``stream``) and ``continues`` (bool), D being the length of ``continues``. ``shard`` and
 *       ``record`` are the window's columns, by document. None, having written nothing, where a
 *       frame has no contiguous buffer; ValueError where the batch and the token after it do
 *       not lie in the window, or it touches another number of documents than D.
 *
 *   member_check(raw, token_offset, num_tokens, meta_offset, meta_size, head, itemsize)
 *           -> -1, (position, kind, expected, said) or None
 *       The tar check of a frame's records (format/tar.py, ``member_mismatch``): the first
 *       record whose .npy member (or .json member, where meta_size > 0) does not have the
 *       size its index row gives in the ustar header before it in ``raw`` (the frame's
 *       decoded bytes), as ``member_mismatch`` reports it (said None where no header fits
 *       or its size field is not 11 octal digits); -1 when every member agrees. ``head``: the
 *       npy header's bytes, the same for every record. None where an index column is not a
 *       1-D integer array (the caller runs the numpy version).
 *
 *   balance_layout(lengths, cap, T, small, alone, round) -> bytearray or None
 *       The balanced layout's dealing of a window's pieces into rows (in _layout.c).
 *
 *   balance_cap(lengths, density, hi) -> int or None
 *       The balanced layout's cap on a window's parts (in _layout.c).
 *
 * The loops over a batch run without the GIL: the buffers are held for the whole call
 * (member_check, a loop over one frame's few hundred records, keeps it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define IGNORE_INDEX (-100)

/* A loop worth an AVX2 build beside the baseline one, chosen when the module loads (GCC's
 * function multi-versioning; it needs the C library's ifunc, hence glibc on x86-64). */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define HOT_LOOP __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef HOT_LOOP
#define HOT_LOOP
#endif

/* An integer (or bool) array: its buffer, and how to read an item. */
typedef struct {
    Py_buffer view;
    int held;
    char kind;    /* 'i' signed, 'u' unsigned, 'b' bool */
    int size;     /* bytes per item: 1, 2, 4 or 8 */
} Arr;

/* The item kind of a native struct-module format of one integer or bool: 0, or -1. */
static int parse_format(const char *fmt, Py_ssize_t itemsize, char *kind)
{
    if (fmt == NULL) {  /* unsigned bytes */
        *kind = 'u';
        return itemsize == 1 ? 0 : -1;
    }
    if (*fmt == '@' || *fmt == '=')
        fmt++;
#if PY_LITTLE_ENDIAN
    else if (*fmt == '<')
        fmt++;
#else
    else if (*fmt == '>' || *fmt == '!')
        fmt++;
#endif
    if (fmt[0] == '\0' || fmt[1] != '\0')
        return -1;
    switch (fmt[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        *kind = 'i';
        break;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        *kind = 'u';
        break;
    case '?':
        *kind = 'b';
        break;
    default:
        return -1;
    }
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
        return -1;
    return (*kind == 'b' && itemsize != 1) ? -1 : 0;
}

/* Whether the error just raised says an object has no buffer of the layout asked for
 * (numpy raises BufferError or ValueError, an object without a buffer TypeError). */
static int no_buffer(void)
{
    return PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_TypeError)
           || PyErr_ExceptionMatches(PyExc_ValueError);
}

/* Takes ``obj``'s buffer into ``a``: 1 on success, 0 where the object has no usable buffer of
 * integers (no exception set), -1 on an error. ``ndim``: the dimensions it must have. */
static int arr_get(PyObject *obj, Arr *a, int ndim, int writable)
{
    int flags = PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) {
        if (!no_buffer())
            return -1;
        PyErr_Clear();
        return 0;
    }
    a->held = 1;
    if (a->view.ndim != ndim || parse_format(a->view.format, a->view.itemsize, &a->kind) < 0)
        return 0;
    a->size = (int)a->view.itemsize;
    return 1;
}

static void arr_release(Arr *a)
{
    if (a->held) {
        PyBuffer_Release(&a->view);
        a->held = 0;
    }
}

/* Item ``i`` of a 1-D array, as int64 (unaligned reads are fine). */
static inline int64_t arr_at(const Arr *a, Py_ssize_t i)
{
    const char *p = (const char *)a->view.buf + i * a->view.strides[0];
    switch (a->size) {
    case 1:
        return a->kind == 'i' ? (int64_t)*(const int8_t *)p : (int64_t)*(const uint8_t *)p;
    case 2: {
        uint16_t v;
        memcpy(&v, p, 2);
        return a->kind == 'i' ? (int64_t)(int16_t)v : (int64_t)v;
    }
    case 4: {
        uint32_t v;
        memcpy(&v, p, 4);
        return a->kind == 'i' ? (int64_t)(int32_t)v : (int64_t)v;
    }
    default: {
        int64_t v;
        memcpy(&v, p, 8);
        return v;
    }
    }
}

/* ``n`` contiguous items of ``kind``/``size`` from ``src``, widened into ``dst`` (int64). */
static inline void widen(int64_t *dst, const char *src, Py_ssize_t n, char kind, int size)
{
    Py_ssize_t j;
#define WIDEN(T)                                  \
    for (j = 0; j < n; j++) {                     \
        T v;                                      \
        memcpy(&v, src + j * sizeof(T), sizeof(T)); \
        dst[j] = (int64_t)v;                      \
    }
    if (kind == 'i') {
        switch (size) {
        case 1: WIDEN(int8_t) break;
        case 2: WIDEN(int16_t) break;
        case 4: WIDEN(int32_t) break;
        default: WIDEN(int64_t) break;
        }
    } else {
        switch (size) {
        case 1: WIDEN(uint8_t) break;
        case 2: WIDEN(uint16_t) break;
        case 4: WIDEN(uint32_t) break;
        default: WIDEN(uint64_t) break;
        }
    }
#undef WIDEN
}

/* An output: None, or a C-contiguous writable array of ``n`` signed integers of ``size``
 * bytes. 1 with ``*data`` set (NULL for None), -1 with TypeError. */
static int out_get(PyObject *obj, Py_buffer *view, void **data, Py_ssize_t n, int size, const char *name)
{
    char kind;
    *data = NULL;
    if (obj == Py_None)
        return 1;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (parse_format(view->format, view->itemsize, &kind) < 0 || kind != 'i' || view->itemsize != size
        || view->len != n * size) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "expand: %s must be a C-contiguous int%d array of %zd items", name,
                     size * 8, n);
        return -1;
    }
    *data = view->buf;
    return 1;
}

/* expand's pass over the batch (the inputs checked; runs without the GIL). Built for AVX2 as
 * well where the compiler and C library can pick the build at load time: the loops are
 * stores of widened items, twice as wide per instruction there. */
HOT_LOOP static void expand_fill(const Arr *tokens, const Arr *lookahead, const Arr *start, const Arr *length,
                                 const Arr *stream, const Arr *continues, int document, Py_ssize_t rows,
                                 Py_ssize_t T, Py_ssize_t P, void *data[5])
{
    int64_t *input_ids = data[0], *labels = data[1], *positions = data[2];
    Py_ssize_t size = rows * T, p, r, i;
    int32_t *doc_ids = data[3], *source_ids = data[4];
    const char *tok = tokens->view.buf;
    Py_ssize_t row_stride = tokens->view.strides[0];
    Py_ssize_t cur_row = -1, row_first = 0;
    int64_t prev_end = 0;

    for (r = 0; r < rows; r++) {
        if (input_ids)
            widen(input_ids + r * T, tok + r * row_stride, T, tokens->kind, tokens->size);
        if (labels)  /* the next token: labels are shifted exactly once, here */
            widen(labels + r * T, tok + r * row_stride + tokens->size, T, tokens->kind, tokens->size);
    }
    for (p = 0; p <= P; p++) {
        int64_t s = p < P ? arr_at(start, p) : (int64_t)size;
        int64_t e = p < P ? s + arr_at(length, p) : (int64_t)size;
        /* padding before the piece (or after the last one) */
        if (s > prev_end) {
            Py_ssize_t a = (Py_ssize_t)prev_end, n = (Py_ssize_t)(s - prev_end);
            if (labels)
                for (i = 0; i < n; i++) labels[a + i] = IGNORE_INDEX;
            if (positions)
                memset(positions + a, 0, n * sizeof(int64_t));
            if (doc_ids)
                memset(doc_ids + a, 0xff, n * sizeof(int32_t));  /* -1 */
            if (source_ids)
                memset(source_ids + a, 0xff, n * sizeof(int32_t));
        }
        if (p == P)
            break;
        {
            int32_t src = (int32_t)arr_at(stream, p);
            Py_ssize_t a = (Py_ssize_t)s;
            while (a < e) {  /* the piece's part in each row it touches */
                Py_ssize_t row = a / T, b = (row + 1) * T < e ? (row + 1) * T : (Py_ssize_t)e, n = b - a;
                if (row != cur_row) {  /* doc ids count the pieces of a row from 0 */
                    cur_row = row;
                    row_first = p;
                }
                if (positions)
                    for (i = 0; i < n; i++) positions[a + i] = i;
                if (doc_ids) {
                    int32_t d = (int32_t)(p - row_first);
                    for (i = 0; i < n; i++) doc_ids[a + i] = d;
                }
                if (source_ids)
                    for (i = 0; i < n; i++) source_ids[a + i] = src;
                a = b;
            }
        }
        if (labels && !arr_at(continues, p)) {  /* the piece ends its document */
            int64_t last = e - 1;
            int ignore;
            if (document) {
                ignore = 1;
            } else if (e % T == 0) {  /* at a row end: -100 unless the next token is known */
                ignore = !arr_at(lookahead, (Py_ssize_t)(last / T));
            } else {  /* mid-row: -100 where padding follows */
                ignore = !(p + 1 < P && arr_at(start, p + 1) == e);
            }
            if (ignore)
                labels[last] = IGNORE_INDEX;
        }
        prev_end = e;
    }
}

static PyObject *core_expand(PyObject *self, PyObject *args)
{
    PyObject *o_tokens, *o_lookahead, *o_start, *o_length, *o_stream, *o_continues;
    PyObject *o_out[5];
    int document;
    static const char *names[5] = {"input_ids", "labels", "position_ids", "doc_ids", "source_ids"};
    static const int sizes[5] = {8, 8, 8, 4, 4};
    Arr tokens = {0}, lookahead = {0}, start = {0}, length = {0}, stream = {0}, continues = {0};
    Py_buffer outs[5];
    void *data[5] = {NULL, NULL, NULL, NULL, NULL};
    int held[5] = {0, 0, 0, 0, 0};
    PyObject *result = NULL;
    Py_ssize_t rows, width, T, size, P, p, i;
    int ok;

    if (!PyArg_ParseTuple(args, "OOOOOOpOOOOO:expand", &o_tokens, &o_lookahead, &o_start, &o_length, &o_stream,
                          &o_continues, &document, &o_out[0], &o_out[1], &o_out[2], &o_out[3], &o_out[4]))
        return NULL;

    /* the inputs: any layout this function does not take goes to the numpy path */
    result = Py_False;
    if ((ok = arr_get(o_tokens, &tokens, 2, 0)) <= 0 || tokens.kind == 'b' ||
        (ok = arr_get(o_lookahead, &lookahead, 1, 0)) <= 0 || (ok = arr_get(o_start, &start, 1, 0)) <= 0 ||
        (ok = arr_get(o_length, &length, 1, 0)) <= 0 || (ok = arr_get(o_stream, &stream, 1, 0)) <= 0 ||
        (ok = arr_get(o_continues, &continues, 1, 0)) <= 0) {
        if (ok < 0)
            result = NULL;
        goto done;
    }
    rows = tokens.view.shape[0];
    width = tokens.view.shape[1];
    T = width - 1;
    if (rows < 1 || T < 1 || tokens.view.strides[1] != tokens.size || lookahead.view.shape[0] != rows)
        goto done;
    size = rows * T;
    P = start.view.shape[0];
    if (length.view.shape[0] != P || stream.view.shape[0] != P || continues.view.shape[0] != P)
        goto done;
    {   /* pieces: non-empty, in order, apart, inside the batch */
        int64_t prev_end = 0;
        for (p = 0; p < P; p++) {
            int64_t s = arr_at(&start, p), n = arr_at(&length, p);
            if (n <= 0 || s < prev_end || n > (int64_t)size - s)
                goto done;
            prev_end = s + n;
        }
    }
    for (i = 0; i < 5; i++) {
        if (out_get(o_out[i], &outs[i], &data[i], size, sizes[i], names[i]) < 0) {
            result = NULL;
            goto done;
        }
        held[i] = data[i] != NULL;
    }

    Py_BEGIN_ALLOW_THREADS
    expand_fill(&tokens, &lookahead, &start, &length, &stream, &continues, document, rows, T, P, data);
    Py_END_ALLOW_THREADS
    result = Py_True;

done:
    for (i = 0; i < 5; i++)
        if (held[i])
            PyBuffer_Release(&outs[i]);
    arr_release(&tokens);
    arr_release(&lookahead);
    arr_release(&start);
    arr_release(&length);
    arr_release(&stream);
    arr_release(&continues);
    Py_XINCREF(result);
    return result;
}

/* The [R, T+1] token grid the fill functions write (their ``tokens``): its buffer, taken
 * writable into ``a``, and its shape. 0; or -1 with TypeError (not a writable 2-D integer
 * array) or ValueError (rows not of adjacent items, or ``offset`` outside the grid's R*T). */
typedef struct {
    Py_ssize_t rows, T, itemsize, row_stride;
} Grid;

static int grid_get(PyObject *obj, Arr *a, Grid *g, Py_ssize_t offset, const char *fn)
{
    int ok = arr_get(obj, a, 2, 1);
    if (ok <= 0) {
        if (ok == 0)
            PyErr_Format(PyExc_TypeError, "%s: tokens must be a writable 2-D array of integers", fn);
        return -1;
    }
    g->rows = a->view.shape[0];
    g->T = a->view.shape[1] - 1;
    g->itemsize = a->size;
    g->row_stride = a->view.strides[0];
    if (g->T < 1 || a->view.strides[1] != g->itemsize || offset < 0 || offset > g->rows * g->T) {
        PyErr_Format(PyExc_ValueError, "%s: tokens must be [R, T+1] with rows of adjacent items, and offset "
                     "inside them", fn);
        return -1;
    }
    return 0;
}

/* Whether tokens from flat position ``offset`` up to ``at`` run past the grid: ValueError then. */
static int run_past(const Grid *g, Py_ssize_t offset, Py_ssize_t at, const char *fn)
{
    if (at <= g->rows * g->T)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: %zd tokens from position %zd run past the %zd of the grid", fn,
                 at - offset, offset, g->rows * g->T);
    return 1;
}

/* Copies ``left`` tokens from ``src`` into the grid's first T columns from flat position
 * ``at`` (rows wrap at T), and returns the position after them. */
static inline Py_ssize_t copy_wrapped(char *grid, Py_ssize_t row_stride, Py_ssize_t itemsize, Py_ssize_t T,
                                      Py_ssize_t at, const char *src, Py_ssize_t left)
{
    while (left > 0) {
        Py_ssize_t row = at / T, col = at % T, n = T - col < left ? T - col : left;
        memcpy(grid + row * row_stride + col * itemsize, src, n * itemsize);
        src += n * itemsize;
        left -= n;
        at += n;
    }
    return at;
}

static PyObject *core_fill_rows(PyObject *self, PyObject *args)
{
    PyObject *o_parts, *o_tokens, *seq = NULL, *result = NULL;
    Py_ssize_t offset, T, itemsize, row_stride, k, nparts, at;
    Arr tokens = {0};
    Grid grid;
    Py_buffer *views = NULL;
    Py_ssize_t nviews = 0;

    if (!PyArg_ParseTuple(args, "OOn:fill_rows", &o_parts, &o_tokens, &offset))
        return NULL;
    if (grid_get(o_tokens, &tokens, &grid, offset, "fill_rows") < 0)
        goto done;
    T = grid.T, itemsize = grid.itemsize, row_stride = grid.row_stride;
    if ((seq = PySequence_Fast(o_parts, "fill_rows: parts must be a sequence")) == NULL)
        goto done;
    nparts = PySequence_Fast_GET_SIZE(seq);
    if ((views = PyMem_Malloc((nparts ? nparts : 1) * sizeof(Py_buffer))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* every part's buffer first: a part this does not take leaves the grid as it was */
    at = offset;
    for (k = 0; k < nparts; k++) {
        Py_buffer *v = &views[k];
        char kind;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            if (!no_buffer())
                goto done;
            PyErr_Clear();
            result = Py_None;
            goto done;
        }
        nviews++;
        if (v->ndim != 1 || v->itemsize != itemsize || parse_format(v->format, v->itemsize, &kind) < 0
            || kind != tokens.kind) {
            result = Py_None;
            goto done;
        }
        at += v->shape[0];
    }
    if (run_past(&grid, offset, at, "fill_rows"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    {
        char *grid = tokens.view.buf;
        at = offset;
        for (k = 0; k < nparts; k++) {
            at = copy_wrapped(grid, row_stride, itemsize, T, at, views[k].buf, views[k].shape[0]);
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(at - offset);
    goto release;

done:
    Py_XINCREF(result);
release:
    for (k = 0; k < nviews; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    Py_XDECREF(seq);
    arr_release(&tokens);
    return result;
}

/* The documents a window run copies lie anywhere in the window's decoded frames (megabytes,
 * in a shuffled order): the first bytes of each are a cache and TLB miss. Asking for the next
 * documents' first lines while one is copied overlaps those misses. */
#define PREFETCH_DOCS 4
#define PREFETCH_LINES 8

static inline void prefetch_span(const char *src, Py_ssize_t nbytes)
{
    Py_ssize_t i;
    for (i = 0; i < PREFETCH_LINES && i * 64 < nbytes; i++)
        __builtin_prefetch(src + i * 64, 0, 0);
}

/* A shuffle window's documents, as fill_window and window_block read them: document d is
 * ``len[d]`` tokens from byte ``start[d]`` of ``frames[frame[d]]``, then the EOS where there
 * is one (``extent`` tokens in all). The frames' buffers are taken as a run needs them. */
typedef struct {
    Arr frame, start, len;
    PyObject *seq;
    Py_buffer *fb;
    char *held;
    Py_ssize_t nframes, ndocs, itemsize;
    int has_eos;
    unsigned char eos_item[8];
} Docs;

static void docs_release(Docs *w)
{
    Py_ssize_t f;
    if (w->held != NULL)
        for (f = 0; f < w->nframes; f++)
            if (w->held[f])
                PyBuffer_Release(&w->fb[f]);
    PyMem_Free(w->fb);
    PyMem_Free(w->held);
    Py_XDECREF(w->seq);
    arr_release(&w->frame);
    arr_release(&w->start);
    arr_release(&w->len);
}

/* The window's columns and frames (no buffer taken yet), tokens of ``itemsize`` bytes: 0, or
 * -1 with an exception. */
static int docs_get(Docs *w, PyObject *frames, PyObject *frame, PyObject *start, PyObject *len, long long eos,
                    Py_ssize_t itemsize, const char *fn)
{
    int ok;
    if ((ok = arr_get(frame, &w->frame, 1, 0)) <= 0 || (ok = arr_get(start, &w->start, 1, 0)) <= 0 ||
        (ok = arr_get(len, &w->len, 1, 0)) <= 0) {
        if (ok == 0)
            PyErr_Format(PyExc_TypeError, "%s: the document columns must be 1-D integer arrays", fn);
        return -1;
    }
    w->ndocs = w->frame.view.shape[0];
    if (w->start.view.shape[0] != w->ndocs || w->len.view.shape[0] != w->ndocs) {
        PyErr_Format(PyExc_ValueError, "%s: the document columns differ in length", fn);
        return -1;
    }
    if ((w->seq = PySequence_Fast(frames, "frames must be a sequence")) == NULL)
        return -1;
    w->nframes = PySequence_Fast_GET_SIZE(w->seq);
    w->fb = PyMem_Calloc(w->nframes ? w->nframes : 1, sizeof(Py_buffer));
    w->held = PyMem_Calloc(w->nframes ? w->nframes : 1, 1);
    if (w->fb == NULL || w->held == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->itemsize = itemsize;
    w->has_eos = eos >= 0;
    {   /* the token after each document, in the grid's item size (native order, as numpy's) */
        uint64_t v = (uint64_t)eos;
        uint32_t v4 = (uint32_t)v;
        uint16_t v2 = (uint16_t)v;
        uint8_t v1 = (uint8_t)v;
        memcpy(w->eos_item, itemsize == 8 ? (void *)&v : itemsize == 4 ? (void *)&v4 : itemsize == 2 ? (void *)&v2
                                                                                               : (void *)&v1,
               (size_t)itemsize);
    }
    return 0;
}

/* Takes the buffers of the frames that the ``size`` tokens from token ``offset`` of document
 * ``pos`` on lie in, every bound checked: the document after the last one they touch; -1 with
 * ValueError (the run outside the window, a document outside its frame), or -2, no exception
 * set, where a frame has no contiguous buffer. */
static Py_ssize_t docs_hold(Docs *w, Py_ssize_t pos, Py_ssize_t offset, Py_ssize_t size, const char *fn)
{
    Py_ssize_t left = size, skip = offset, d;
    for (d = pos; left > 0; d++) {
        int64_t f, st, n, extent;
        if (d < 0 || d >= w->ndocs) {
            PyErr_Format(PyExc_ValueError, "%s: %zd tokens from document %zd token %zd run past the window's %zd "
                         "documents", fn, size, pos, offset, w->ndocs);
            return -1;
        }
        f = arr_at(&w->frame, d);
        st = arr_at(&w->start, d);
        n = arr_at(&w->len, d);
        if (f < 0 || f >= w->nframes || st < 0 || n < 0) {
            PyErr_Format(PyExc_ValueError, "%s: document %zd names frame %lld of %zd, bytes from %lld, %lld tokens",
                         fn, d, (long long)f, w->nframes, (long long)st, (long long)n);
            return -1;
        }
        if (!w->held[f]) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(w->seq, f), &w->fb[f], PyBUF_C_CONTIGUOUS) < 0) {
                if (!no_buffer())
                    return -1;
                PyErr_Clear();
                return -2;
            }
            w->held[f] = 1;
        }
        if (n > (w->fb[f].len - st) / w->itemsize) {
            PyErr_Format(PyExc_ValueError, "%s: document %zd (%lld tokens from byte %lld) lies outside frame %lld "
                         "(%zd bytes)", fn, d, (long long)n, (long long)st, (long long)f, w->fb[f].len);
            return -1;
        }
        extent = n + w->has_eos;
        if (skip >= extent) {
            PyErr_Format(PyExc_ValueError, "%s: token %zd is outside document %zd (%lld tokens)", fn, skip, d,
                         (long long)extent);
            return -1;
        }
        left -= extent - skip < left ? extent - skip : left;
        skip = 0;
    }
    return d;
}

static inline const char *doc_bytes(const Docs *w, Py_ssize_t d)
{
    return (const char *)w->fb[arr_at(&w->frame, d)].buf + arr_at(&w->start, d);
}

/* Copies the ``size`` tokens from token ``offset`` of document ``pos`` on (held by
 * ``docs_hold``, up to document ``d_end``) into the grid from flat position ``at``; the
 * position after them. ``taken``: where to count each document's tokens copied, or NULL.
 * Runs without the GIL. */
static Py_ssize_t docs_copy(const Docs *w, const Grid *g, char *grid, Py_ssize_t pos, Py_ssize_t offset,
                            Py_ssize_t size, Py_ssize_t d_end, Py_ssize_t at, int64_t *taken)
{
    Py_ssize_t left = size, skip = offset, d, itemsize = w->itemsize;
    for (d = pos; d < d_end && d < pos + PREFETCH_DOCS; d++)
        prefetch_span(doc_bytes(w, d), arr_at(&w->len, d) * itemsize);
    for (d = pos; left > 0; d++) {
        Py_ssize_t n = (Py_ssize_t)arr_at(&w->len, d), was = left;
        const char *src = doc_bytes(w, d);
        if (d + PREFETCH_DOCS < d_end)
            prefetch_span(doc_bytes(w, d + PREFETCH_DOCS), arr_at(&w->len, d + PREFETCH_DOCS) * itemsize);
        if (skip < n) {
            Py_ssize_t m = n - skip < left ? n - skip : left;
            at = copy_wrapped(grid, g->row_stride, itemsize, g->T, at, src + skip * itemsize, m);
            left -= m;
        }
        if (left > 0 && w->has_eos) {
            at = copy_wrapped(grid, g->row_stride, itemsize, g->T, at, (const char *)w->eos_item, 1);
            left -= 1;
        }
        if (taken != NULL)
            taken[d - pos] = was - left;
        skip = 0;
    }
    return at;
}

static PyObject *core_fill_window(PyObject *self, PyObject *args)
{
    PyObject *o_frames, *o_frame, *o_start, *o_len, *o_tokens, *result = NULL;
    long long eos;
    Py_ssize_t pos, offset, size, filled, d_end, at;
    Arr tokens = {0};
    Docs w = {0};
    Grid grid;

    if (!PyArg_ParseTuple(args, "OOOOLnnnOn:fill_window", &o_frames, &o_frame, &o_start, &o_len, &eos, &pos,
                          &offset, &size, &o_tokens, &filled))
        return NULL;
    if (grid_get(o_tokens, &tokens, &grid, filled, "fill_window") < 0 ||
        docs_get(&w, o_frames, o_frame, o_start, o_len, eos, grid.itemsize, "fill_window") < 0)
        goto done;
    if (size < 0 || size > grid.rows * grid.T - filled) {
        PyErr_Format(PyExc_ValueError, "fill_window: %zd tokens from position %zd do not fit the %zd of the grid",
                     size, filled, grid.rows * grid.T);
        goto done;
    }
    if ((d_end = docs_hold(&w, pos, offset, size, "fill_window")) < 0) {
        if (d_end == -2)
            result = Py_None;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    at = docs_copy(&w, &grid, tokens.view.buf, pos, offset, size, d_end, filled, NULL);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(at - filled);
    goto release;

done:
    Py_XINCREF(result);
release:
    docs_release(&w);
    arr_release(&tokens);
    return result;
}

/* A writable C-contiguous array of ``n`` items of ``kind`` and ``size`` bytes (``rows`` of
 * them, where rows > 1): 0 with ``view`` held, or -1 with TypeError. */
static int column_get(PyObject *obj, Py_buffer *view, Py_ssize_t n, char kind, int size, const char *name)
{
    char got;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (parse_format(view->format, view->itemsize, &got) < 0 || got != kind || view->itemsize != size ||
        view->len != n * size) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "window_block: %s must be a C-contiguous array of %zd items of %d bytes",
                     name, n, size);
        return -1;
    }
    return 0;
}

/* Where token ``k`` of document ``d``, counted with its EOS, lies (held by docs_hold). */
static inline const char *doc_item(const Docs *w, Py_ssize_t d, int64_t k)
{
    return k < arr_at(&w->len, d) ? doc_bytes(w, d) + k * w->itemsize : (const char *)w->eos_item;
}

static PyObject *core_window_block(PyObject *self, PyObject *args)
{
    PyObject *o_frames, *o_frame, *o_start, *o_len, *o_shard, *o_record, *o_tokens, *o_cols, *o_shard32,
        *o_stream16, *o_continues, *result = NULL;
    long long eos;
    Py_ssize_t pos, offset, D, d_end, i;
    int stream;
    Arr tokens = {0}, shard = {0}, record = {0};
    Docs w = {0};
    Grid grid;
    Py_buffer cols, shard32, stream16, continues;
    int held = 0, ok;

    if (!PyArg_ParseTuple(args, "OOOOLnniOOOOOOO:window_block", &o_frames, &o_frame, &o_start, &o_len, &eos,
                          &pos, &offset, &stream, &o_shard, &o_record, &o_tokens, &o_cols, &o_shard32,
                          &o_stream16, &o_continues))
        return NULL;
    if (grid_get(o_tokens, &tokens, &grid, 0, "window_block") < 0 ||
        docs_get(&w, o_frames, o_frame, o_start, o_len, eos, grid.itemsize, "window_block") < 0)
        goto done;
    if ((ok = arr_get(o_shard, &shard, 1, 0)) <= 0 || (ok = arr_get(o_record, &record, 1, 0)) <= 0) {
        if (ok == 0)
            PyErr_SetString(PyExc_TypeError, "window_block: shard and record must be 1-D integer arrays");
        goto done;
    }
    if (shard.view.shape[0] != w.ndocs || record.view.shape[0] != w.ndocs) {
        PyErr_SetString(PyExc_ValueError, "window_block: shard and record differ in length from the documents");
        goto done;
    }
    if ((D = PyObject_Length(o_continues)) < 0)  /* the pieces: as many as continues has items */
        goto done;
    if (column_get(o_cols, &cols, 4 * D, 'i', 8, "columns") < 0)
        goto done;
    held = 1;
    if (column_get(o_shard32, &shard32, D, 'i', 4, "shard") < 0)
        goto done;
    held = 2;
    if (column_get(o_stream16, &stream16, D, 'i', 2, "stream") < 0)
        goto done;
    held = 3;
    if (column_get(o_continues, &continues, D, 'b', 1, "continues") < 0)
        goto done;
    held = 4;
    /* the batch and the token after it, which the last row's column T holds */
    if ((d_end = docs_hold(&w, pos, offset, grid.rows * grid.T + 1, "window_block")) < 0) {
        if (d_end == -2)
            result = Py_None;
        goto done;
    }
    {
        int64_t *start = cols.buf, *length = start + D, *rec = length + D, *token_start = rec + D;
        int32_t *sh = shard32.buf;
        int16_t *st = stream16.buf;
        char *cont = continues.buf, *g = tokens.view.buf;
        Py_ssize_t size = grid.rows * grid.T, last, r;
        int64_t sum = 0, used, extent;
        /* the documents the batch touches: as many as the pieces the caller counted */
        used = offset;
        for (last = pos, sum = 0; last + 1 < d_end; last++) {
            extent = arr_at(&w.len, last) + w.has_eos;
            if (sum + extent - used >= size)
                break;
            sum += extent - used;
            used = 0;
        }
        if (last - pos + 1 != D) {
            PyErr_Format(PyExc_ValueError, "window_block: the batch touches %zd documents, not the %zd pieces given",
                         last - pos + 1, D);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        docs_copy(&w, &grid, g, pos, offset, size, d_end, 0, length);
        for (r = 0; r + 1 < grid.rows; r++)  /* column T: the token after each row, the next row's first */
            memcpy(g + r * grid.row_stride + grid.T * grid.itemsize, g + (r + 1) * grid.row_stride,
                   (size_t)grid.itemsize);
        Py_END_ALLOW_THREADS
        sum = 0;
        for (i = 0; i < D; i++) {
            start[i] = sum;
            sum += length[i];
            rec[i] = arr_at(&record, pos + i);
            sh[i] = (int32_t)arr_at(&shard, pos + i);
            st[i] = (int16_t)stream;
            token_start[i] = i == 0 ? offset : 0;
            cont[i] = 0;
        }
        /* the last piece: cut short of its document's end, or ending it */
        used = (D == 1 ? offset : 0) + length[D - 1];
        extent = arr_at(&w.len, last) + w.has_eos;
        cont[D - 1] = used < extent;
        memcpy(g + (grid.rows - 1) * grid.row_stride + grid.T * grid.itemsize,
               used < extent ? doc_item(&w, last, used) : doc_item(&w, last + 1, 0), (size_t)grid.itemsize);
    }
    result = Py_True;

done:
    Py_XINCREF(result);
    if (held >= 1)
        PyBuffer_Release(&cols);
    if (held >= 2)
        PyBuffer_Release(&shard32);
    if (held >= 3)
        PyBuffer_Release(&stream16);
    if (held >= 4)
        PyBuffer_Release(&continues);
    docs_release(&w);
    arr_release(&tokens);
    arr_release(&shard);
    arr_release(&record);
    return result;
}

static PyObject *core_fill_parts(PyObject *self, PyObject *args)
{
    PyObject *o_source, *o_starts, *o_lengths, *o_tokens, *result = NULL;
    Py_ssize_t offset, T, itemsize, row_stride, k, nparts, at, size;
    Arr tokens = {0}, source = {0}, starts = {0}, lengths = {0};
    Grid grid;
    int ok;

    if (!PyArg_ParseTuple(args, "OOOOn:fill_parts", &o_source, &o_starts, &o_lengths, &o_tokens, &offset))
        return NULL;
    if (grid_get(o_tokens, &tokens, &grid, offset, "fill_parts") < 0)
        goto done;
    T = grid.T, itemsize = grid.itemsize, row_stride = grid.row_stride;
    if ((ok = arr_get(o_starts, &starts, 1, 0)) <= 0 || (ok = arr_get(o_lengths, &lengths, 1, 0)) <= 0) {
        if (ok == 0)
            PyErr_SetString(PyExc_TypeError, "fill_parts: starts and lengths must be 1-D arrays of integers");
        goto done;
    }
    nparts = starts.view.shape[0];
    if (lengths.view.shape[0] != nparts) {
        PyErr_SetString(PyExc_ValueError, "fill_parts: starts and lengths must be of one size");
        goto done;
    }
    if ((ok = arr_get(o_source, &source, 1, 0)) < 0)
        goto done;
    if (ok == 0 || source.size != itemsize || source.kind != tokens.kind || source.view.strides[0] != itemsize) {
        PyErr_Clear();
        result = Py_None;
        goto done;
    }
    size = source.view.shape[0];
    at = offset;
    for (k = 0; k < nparts; k++) {
        int64_t a = arr_at(&starts, k), n = arr_at(&lengths, k);
        if (a < 0 || n < 0 || a > size || n > size - a) {
            PyErr_Format(PyExc_ValueError, "fill_parts: part %zd (%lld tokens from %lld) lies outside the %zd "
                         "tokens of source", k, (long long)n, (long long)a, size);
            goto done;
        }
        at += (Py_ssize_t)n;
    }
    if (run_past(&grid, offset, at, "fill_parts"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    {
        char *grid = tokens.view.buf;
        const char *base = source.view.buf;
        at = offset;
        for (k = 0; k < nparts; k++) {
            at = copy_wrapped(grid, row_stride, itemsize, T, at, base + arr_at(&starts, k) * itemsize,
                              (Py_ssize_t)arr_at(&lengths, k));
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(at - offset);
    goto release;

done:
    Py_XINCREF(result);
release:
    arr_release(&source);
    arr_release(&starts);
    arr_release(&lengths);
    arr_release(&tokens);
    return result;
}

/* The size a ustar header at ``at`` of ``raw`` gives its member: -1 where no header fits
 * there or its size field (11 bytes from offset 124) is not octal digits. */
static inline int64_t header_size(const unsigned char *raw, Py_ssize_t len, int64_t at)
{
    int64_t value = 0;
    int k;
    if (at < 0 || at + 512 > (int64_t)len)
        return -1;
    for (k = 0; k < 11; k++) {
        unsigned char c = raw[at + 124 + k];
        if (c < '0' || c > '7')
            return -1;
        value = value * 8 + (c - '0');
    }
    return value;
}

static PyObject *core_member_check(PyObject *self, PyObject *args)
{
    PyObject *o_raw, *o_off, *o_num, *o_moff, *o_msize, *result = NULL;
    long long head, itemsize;
    Py_buffer raw;
    Arr off = {0}, num = {0}, moff = {0}, msize = {0};
    Py_ssize_t n, i;
    int ok;

    if (!PyArg_ParseTuple(args, "OOOOOLL:member_check", &o_raw, &o_off, &o_num, &o_moff, &o_msize, &head,
                          &itemsize))
        return NULL;
    if (PyObject_GetBuffer(o_raw, &raw, PyBUF_SIMPLE) < 0)
        return NULL;
    if ((ok = arr_get(o_off, &off, 1, 0)) == 1 && (ok = arr_get(o_num, &num, 1, 0)) == 1
        && (ok = arr_get(o_moff, &moff, 1, 0)) == 1)
        ok = arr_get(o_msize, &msize, 1, 0);
    if (ok < 0)
        goto release;
    n = off.view.shape[0];
    if (ok == 0 || num.view.shape[0] != n || moff.view.shape[0] != n || msize.view.shape[0] != n) {
        result = Py_None;
        Py_INCREF(result);
        goto release;
    }
    for (i = 0; i < n; i++) {
        const unsigned char *buf = (const unsigned char *)raw.buf;
        int64_t expected = head + arr_at(&num, i) * itemsize;
        int64_t said = header_size(buf, raw.len, arr_at(&off, i) - (512 + head));
        const char *kind = "npy";
        if (said == expected) {
            expected = arr_at(&msize, i);
            if (expected <= 0)
                continue;
            said = header_size(buf, raw.len, arr_at(&moff, i) - 512);
            if (said == expected)
                continue;
            kind = "json";
        }
        if (said < 0)
            result = Py_BuildValue("(nsLO)", i, kind, (long long)expected, Py_None);
        else
            result = Py_BuildValue("(nsLL)", i, kind, (long long)expected, (long long)said);
        goto release;
    }
    result = PyLong_FromLong(-1);
release:
    PyBuffer_Release(&raw);
    arr_release(&off);
    arr_release(&num);
    arr_release(&moff);
    arr_release(&msize);
    return result;
}

PyObject *core_balance_layout(PyObject *self, PyObject *args); /* _layout.c */
PyObject *core_balance_cap(PyObject *self, PyObject *args);    /* _layout.c */

static PyMethodDef core_methods[] = {
    {"expand", core_expand, METH_VARARGS,
     "expand(tokens, lookahead, start, length, stream, continues, document, input_ids, labels, position_ids, "
     "doc_ids, source_ids) -> bool\n\nFill the batch contract's arrays (None: not wanted) from a RowBatch's "
     "columns; False, having written nothing, for a layout left to the numpy path."},
    {"fill_rows", core_fill_rows, METH_VARARGS,
     "fill_rows(parts, tokens, offset) -> int | None\n\nWrite the parts, end to end, into the [R, T+1] grid "
     "from flat position offset of its first T columns; the tokens written, or None (nothing written) "
     "where a part is not a contiguous 1-D array of the grid's dtype."},
    {"fill_parts", core_fill_parts, METH_VARARGS,
     "fill_parts(source, starts, lengths, tokens, offset) -> int | None\n\nAs fill_rows, the parts being the spans "
     "source[starts[k]:starts[k] + lengths[k]]; None (nothing written) where source is not a contiguous 1-D "
     "array of the grid's dtype."},
    {"fill_window", core_fill_window, METH_VARARGS,
     "fill_window(frames, doc_frame, doc_start, doc_len, eos, pos, offset, size, tokens, filled) -> int | None\n\n"
     "As fill_rows, the parts being a shuffle window's documents read from its decoded frames (document d: "
     "doc_len[d] tokens from byte doc_start[d] of frames[doc_frame[d]], then eos where eos >= 0), size tokens "
     "from token offset of document pos on; None (nothing written) where a frame has no contiguous buffer."},
    {"window_block", core_window_block, METH_VARARGS,
     "window_block(frames, doc_frame, doc_start, doc_len, eos, pos, offset, stream, shard, record, tokens, columns, "
     "shard32, stream16, continues) -> True | None\n\nA whole [R, T+1] batch from one shuffle window, from token "
     "offset of document pos on: its tokens, the token after each row in column T, and its pieces' columns; None "
     "(nothing written) where a frame has no contiguous buffer."},
    {"member_check", core_member_check, METH_VARARGS,
     "member_check(raw, token_offset, num_tokens, meta_offset, meta_size, head, itemsize) -> int | tuple | None\n\n"
     "The first record of a frame whose tar member has another size than its index row gives, as "
     "(position, kind, expected, said); -1 when none; None where a column is not a 1-D integer array."},
    {"balance_layout", core_balance_layout, METH_VARARGS,
     "balance_layout(lengths, cap, T, small, alone, round) -> bytearray | None\n\nThe balanced layout's parts "
     "(row, piece, offset, length; 4*P int64 items) of a window's piece lengths cut at cap; None where lengths "
     "is not a contiguous int64 array."},
    {"balance_cap", core_balance_cap, METH_VARARGS,
     "balance_cap(lengths, density, hi) -> int | None\n\nThe smallest cap (at most hi) at which the lengths "
     "cut at it reach density; None where lengths is not a contiguous int64 array."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core",
    "The compiled core of streamforge's per-batch hot loops (streamforge.pipeline.core chooses it).", -1,
    core_methods,
};

PyMODINIT_FUNC PyInit__core(void)
{
    return PyModule_Create(&core_module);
}
