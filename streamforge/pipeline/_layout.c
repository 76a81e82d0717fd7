/* The balanced layout's hot loop, part of streamforge.pipeline._core (see _core.c):
 *
 *   balance_layout(lengths, cap, T, small, alone, round[, renumber]) -> bytearray
 *       The parts of ``stages/layout_balance.lay_out`` after its cap is chosen: ``lengths``
 *       (a C-contiguous int64 array, the window's pieces) cut at ``cap`` into near-equal
 *       parts, the parts of at least ``alone`` tokens dealt one by one, those of at least
 *       ``small`` a round (``round`` of the rows with room) at a time, the rest filling the
 *       rooms; returned as 4*P int64 items (row, piece, offset and length of the P parts, in
 *       that order, each by row, then cut-before-the-piece's-end last, then piece, then
 *       offset). With ``renumber`` true, each piece's parts take its tokens in that order
 *       (the offsets renumbered, ``layout_balance.in_row_order``) and are sorted again. The numpy twin is ``layout_balance._deal_numpy``: the same parts, bit for bit
 *       (every float is a sum or product of integers below 2**53, or one division, computed
 *       in the same order; ties go to the lower row as numpy's argmin and stable argsort do).
 *       None where ``lengths`` is not a contiguous int64 array (the caller runs numpy).
 *
 * The loop runs without the GIL.
 */
#if defined(__clang__)
#pragma clang fp contract(off) /* no fused multiply-add: the floats must be numpy's, bit for bit */
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

PyObject *core_balance_layout(PyObject *self, PyObject *args);
PyObject *core_balance_cap(PyObject *self, PyObject *args);

typedef struct {
    int64_t row, cut, piece, offset, length;
} Part;

typedef struct {
    double key;
    int64_t index;
} Keyed;

/* parts by size, longest first, then by index (their reading order) */
static const int64_t *g_size;

static int cmp_size(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    if (g_size[x] != g_size[y])
        return g_size[x] > g_size[y] ? -1 : 1;
    return x < y ? -1 : (x > y);
}

static int cmp_keyed(const void *a, const void *b)
{
    const Keyed *x = a, *y = b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);
}

static int cmp_part(const void *a, const void *b)
{
    const Part *x = a, *y = b;
    if (x->row != y->row)
        return x->row < y->row ? -1 : 1;
    if (x->cut != y->cut)
        return x->cut < y->cut ? -1 : 1;
    if (x->piece != y->piece)
        return x->piece < y->piece ? -1 : 1;
    return x->offset < y->offset ? -1 : (x->offset > y->offset);
}

typedef struct {
    Py_ssize_t nrows;
    int64_t *room;
    double *cost;
    Part *out;
    Py_ssize_t nout;
} Rows;

static void emit(Rows *s, int64_t r, int64_t p, int64_t off, int64_t n)
{
    Part *q = &s->out[s->nout++];
    q->row = r;
    q->piece = p;
    q->offset = off;
    q->length = n;
    s->cost[r] += (double)n * (double)n;
    s->room[r] -= n;
}

/* one part to the row of least projected cost (``deal`` in lay_out) */
static void deal(Rows *s, double rest, int64_t p, int64_t off, int64_t left)
{
    const double big = (double)((int64_t)1 << 62);
    while (left > 0) {
        Py_ssize_t r, best = -1;
        double low = 0, score;
        int fits = 0;
        int64_t take;
        for (r = 0; r < s->nrows; r++)
            if (s->room[r] >= left) {
                fits = 1;
                break;
            }
        for (r = 0; r < s->nrows; r++) {
            if (fits)
                score = s->room[r] >= left ? s->cost[r] + (double)s->room[r] * rest : big;
            else
                score = s->room[r] == 0 ? big : s->cost[r] + (double)s->room[r] * (double)s->room[r];
            if (best < 0 || score < low) {
                best = r;
                low = score;
            }
        }
        take = fits ? left : s->room[best];
        emit(s, best, p, off, take);
        off += take;
        left -= take;
    }
}

static int layout(const int64_t *lengths, Py_ssize_t npieces, int64_t cap, int64_t T, double small, double alone_len,
                  double round_share, int renumber, Rows *s)
{
    int64_t total = 0, P = 0, i, j, k, u;
    int64_t *piece = NULL, *offset = NULL, *size = NULL, *order = NULL, *rows = NULL;
    double *rest = NULL;
    Keyed *keyed = NULL;
    char *fit = NULL;
    Py_ssize_t split, alone, r, f;
    int ok = 0;

    for (i = 0; i < npieces; i++) {
        total += lengths[i];
        P += lengths[i] > cap ? (lengths[i] + cap - 1) / cap : 1;
    }
    s->nrows = (Py_ssize_t)((total + T - 1) / T);
    piece = malloc((P + 1) * sizeof(int64_t));
    offset = malloc((P + 1) * sizeof(int64_t));
    size = malloc((P + 1) * sizeof(int64_t));
    order = malloc((P + 1) * sizeof(int64_t));
    rest = malloc((P + 1) * sizeof(double));
    s->room = malloc((s->nrows + 1) * sizeof(int64_t));
    s->cost = calloc(s->nrows + 1, sizeof(double));
    rows = malloc((s->nrows + 1) * sizeof(int64_t));
    keyed = malloc((s->nrows + 1) * sizeof(Keyed));
    fit = malloc((size_t)s->nrows + 1);
    s->out = malloc((P + 2 * s->nrows + 2) * sizeof(Part));
    s->nout = 0;
    if (!piece || !offset || !size || !order || !rest || !s->room || !s->cost || !rows || !keyed || !fit || !s->out)
        goto done;
    /* the pieces cut into near-equal parts, empty ones dropped */
    P = 0;
    for (i = 0; i < npieces; i++) {
        int64_t L = lengths[i], n = L > cap ? (L + cap - 1) / cap : 1, base = L / n, extra = L % n;
        for (k = 0; k < n; k++) {
            int64_t sz = base + (k < extra);
            if (sz <= 0)
                continue;
            piece[P] = i;
            offset[P] = k * base + (k < extra ? k : extra);
            size[P] = sz;
            order[P] = P;
            P++;
        }
    }
    g_size = size;
    qsort(order, (size_t)P, sizeof(int64_t), cmp_size);
    /* the density of the parts after each one (longest first) */
    {
        double later_sq = 0, later = 0;
        for (j = P - 1; j >= 0; j--) {
            rest[j] = later > 0 ? later_sq / (later > 1.0 ? later : 1.0) : 0.0;
            later_sq += (double)size[order[j]] * (double)size[order[j]];
            later += (double)size[order[j]];
        }
    }
    for (r = 0; r < s->nrows; r++)
        s->room[r] = T;
    s->room[s->nrows - 1] = total - (int64_t)(s->nrows - 1) * T;
    for (split = 0; split < P && (double)size[order[split]] >= small; split++)
        ;
    for (alone = 0; alone < P && (double)size[order[alone]] >= alone_len; alone++)
        ;
    if (alone > split)
        alone = split;
    if (alone > s->nrows)
        alone = s->nrows;
    for (j = 0; j < alone; j++)
        deal(s, rest[j], piece[order[j]], offset[order[j]], size[order[j]]);
    while (j < split) { /* a round: the next parts to the rows of least projected cost */
        Py_ssize_t nfree = 0, m;
        double rj;
        for (r = 0; r < s->nrows; r++)
            if (s->room[r] > 0)
                rows[nfree++] = r;
        m = (Py_ssize_t)((double)nfree * round_share);
        k = split - j < (m > 1 ? m : 1) ? split - j : (m > 1 ? m : 1);
        rj = rest[j + k - 1];
        for (f = 0; f < nfree; f++) {
            keyed[f].key = s->cost[rows[f]] + (double)s->room[rows[f]] * rj;
            keyed[f].index = rows[f];
        }
        qsort(keyed, (size_t)nfree, sizeof(Keyed), cmp_keyed);
        if (nfree < k)
            goto done; /* numpy refuses this (shapes differ); it cannot happen: the rooms hold every token */
        for (f = 0; f < k; f++) { /* the parts that fit their row (the rows differ: no room changes twice) */
            u = order[j + f];
            fit[f] = s->room[keyed[f].index] >= size[u];
            if (fit[f])
                emit(s, keyed[f].index, piece[u], offset[u], size[u]);
        }
        for (f = 0; f < k; f++) /* then the others, one by one */
            if (!fit[f]) {
                u = order[j + f];
                deal(s, rj, piece[u], offset[u], size[u]);
            }
        j += k;
    }
    /* the short parts fill the rooms: the rows needing the most density take the longest */
    if (split < P) {
        double final = 0, sq = 0;
        Py_ssize_t nopen = 0, at = 0;
        int64_t used = 0, bound;
        for (r = 0; r < s->nrows; r++)
            final += s->cost[r];
        for (j = split; j < P; j++)
            sq += (double)size[order[j]] * (double)size[order[j]];
        final = (final + sq) / (double)s->nrows;
        for (r = 0; r < s->nrows; r++)
            if (s->room[r] > 0) {
                keyed[nopen].key = -((final - s->cost[r]) / (double)s->room[r]);
                keyed[nopen].index = r;
                nopen++;
            }
        qsort(keyed, (size_t)nopen, sizeof(Keyed), cmp_keyed);
        for (f = 0; f < nopen; f++)
            rows[f] = s->room[keyed[f].index]; /* the rooms, before they are filled */
        bound = nopen ? rows[0] : 0;
        for (j = split; j < P && at < nopen; j++) {
            int64_t done_ = 0, n;
            u = order[j];
            while (done_ < size[u] && at < nopen) {
                n = size[u] - done_ < bound - used ? size[u] - done_ : bound - used;
                emit(s, keyed[at].index, piece[u], offset[u] + done_, n);
                done_ += n;
                used += n;
                if (used == bound && ++at < nopen)
                    bound += rows[at];
            }
        }
    }
    for (f = 0; f < s->nout; f++) {
        Part *q = &s->out[f];
        q->cut = q->offset + q->length < lengths[q->piece];
    }
    qsort(s->out, (size_t)s->nout, sizeof(Part), cmp_part);
    if (renumber) { /* each piece's parts take its tokens in this order: offsets renumbered, sorted again */
        int64_t *taken = calloc((size_t)npieces + 1, sizeof(int64_t));
        if (!taken)
            goto done;
        for (f = 0; f < s->nout; f++) {
            Part *q = &s->out[f];
            q->offset = taken[q->piece];
            taken[q->piece] += q->length;
            q->cut = q->offset + q->length < lengths[q->piece];
        }
        free(taken);
        qsort(s->out, (size_t)s->nout, sizeof(Part), cmp_part);
    }
    ok = 1;
done:
    free(piece);
    free(offset);
    free(size);
    free(order);
    free(rest);
    free(rows);
    free(keyed);
    free(fit);
    return ok;
}

PyObject *core_balance_layout(PyObject *self, PyObject *args)
{
    PyObject *o_lengths, *result = NULL;
    long long cap, T;
    double small, alone_len, round_share;
    int renumber = 0;
    Py_buffer view;
    Rows s = {0};
    const char *fmt;
    int ok;
    Py_ssize_t f;

    if (!PyArg_ParseTuple(args, "OLLddd|p:balance_layout", &o_lengths, &cap, &T, &small, &alone_len, &round_share,
                          &renumber))
        return NULL;
    if (cap < 1 || T < 1) {
        PyErr_SetString(PyExc_ValueError, "balance_layout: cap and T must be >= 1");
        return NULL;
    }
    if (PyObject_GetBuffer(o_lengths, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    fmt = view.format ? view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (view.ndim != 1 || view.itemsize != 8 || !(strcmp(fmt, "l") == 0 || strcmp(fmt, "q") == 0)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    for (f = 0; f < view.shape[0]; f++)
        if (((const int64_t *)view.buf)[f] < 0) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_ValueError, "balance_layout: a length is negative");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ok = layout((const int64_t *)view.buf, view.shape[0], (int64_t)cap, (int64_t)T, small, alone_len, round_share, renumber,
               &s);
    Py_END_ALLOW_THREADS
    if (!ok)
        PyErr_NoMemory();
    else if ((result = PyByteArray_FromStringAndSize(NULL, 4 * s.nout * (Py_ssize_t)sizeof(int64_t))) != NULL) {
        int64_t *dst = (int64_t *)PyByteArray_AS_STRING(result);
        for (f = 0; f < s.nout; f++) {
            dst[f] = s.out[f].row;
            dst[s.nout + f] = s.out[f].piece;
            dst[2 * s.nout + f] = s.out[f].offset;
            dst[3 * s.nout + f] = s.out[f].length;
        }
    }
    PyBuffer_Release(&view);
    free(s.room);
    free(s.cost);
    free(s.out);
    return result;
}

/* sum over the lengths cut at ``cap`` of their parts' squares (``_density``'s numerator) */
static int64_t squares(const int64_t *x, Py_ssize_t n, int64_t cap)
{
    int64_t sum = 0;
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        int64_t L = x[i], k, base, extra;
        if (L <= cap) { /* one part: no division */
            sum += L * L;
            continue;
        }
        k = (L + cap - 1) / cap;
        base = L / k;
        extra = L % k;
        sum += extra * (base + 1) * (base + 1) + (k - extra) * base * base;
    }
    return sum;
}

/* ``layout_balance._cap_for``: the smallest cap (at most ``hi``) at which the lengths reach
 * ``density``, on the same two grids of 32 caps (numpy's linspace: i * step + start, the last
 * one the stop; truncated, repeats dropped) */
static int64_t cap_for(const int64_t *x, Py_ssize_t n, double density, int64_t hi)
{
    int64_t lo = 1, total = 0, caps[32];
    Py_ssize_t i, m, round_;
    for (i = 0; i < n; i++)
        total += x[i];
    if ((double)squares(x, n, hi) / (double)total <= density)
        return hi;
    for (round_ = 0; round_ < 2; round_++) {
        double start = (double)lo, step = ((double)hi - (double)lo) / 31.0;
        m = 0;
        for (i = 0; i < 32; i++) {
            double y = i == 31 ? (double)hi : (double)i * step + start;
            int64_t c = (int64_t)y;
            if (m == 0 || c != caps[m - 1])
                caps[m++] = c;
        }
        { /* the density grows with the cap (a piece's squares only grow as its parts get fewer):
           * the first cap that reaches it, by bisection, as numpy's searchsorted on the grid */
            Py_ssize_t a = 0, b = m;
            while (a < b) {
                Py_ssize_t c = a + (b - a) / 2;
                if ((double)squares(x, n, caps[c]) / (double)total >= density)
                    b = c;
                else
                    a = c + 1;
            }
            i = a;
        }
        if (i == m)
            return hi;
        lo = caps[i > 0 ? i - 1 : 0];
        hi = caps[i];
        if (hi - lo <= 1)
            break;
    }
    return hi;
}

PyObject *core_balance_cap(PyObject *self, PyObject *args)
{
    PyObject *o_lengths;
    long long hi;
    double density;
    Py_buffer view;
    const char *fmt;
    int64_t got;

    if (!PyArg_ParseTuple(args, "OdL:balance_cap", &o_lengths, &density, &hi))
        return NULL;
    if (hi < 1) {
        PyErr_SetString(PyExc_ValueError, "balance_cap: hi must be >= 1");
        return NULL;
    }
    if (PyObject_GetBuffer(o_lengths, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    fmt = view.format ? view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@')
        fmt++;
    if (view.ndim != 1 || view.itemsize != 8 || !(strcmp(fmt, "l") == 0 || strcmp(fmt, "q") == 0)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    got = cap_for((const int64_t *)view.buf, view.shape[0], density, (int64_t)hi);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)got);
}
