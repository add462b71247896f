/* RESP bulk strings received straight into their buffers, without the GIL: cachestore/landing.py is its only caller.
 *
 * A run of replies, each expected to be a bulk string of a known length (a frame and the buffer it lands in, or the
 * pieces it is scattered across), is read off a socket in one call: the header is parsed here, the value received
 * with readv straight into its pieces, its CRLF checked, and on to the next. The first reply that is anything else
 * (a null, an error, a bulk string of another length, a header this does not recognise) is left unread, where it
 * starts, for the Python parser, which handles every RESP2 and RESP3 reply and refuses what is not one. Bytes from
 * Redis are untrusted: a header is at most 11 characters of digits here, a value at most Redis's own 512 MiB, and
 * nothing is written outside the buffers the caller lent.
 *
 * The socket's own timeout is kept: a read that would block waits in poll() for at most that long.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/uio.h>

#define MAX_BULK (512LL << 20) /* Redis's proto-max-bulk-len, as landing.MAX_BULK */
#define MAX_IOV 64             /* pieces per readv */
#define LONGEST_HEADER 32      /* "$536870912\r\n" is 12: this many bytes without a CRLF is for Python to judge */
#define REPORTED_READ (256 << 10) /* the most one read takes into pieces that are reported: they stay in L2 */

enum { OK = 0, CLOSED = 1, TIMEOUT = 2, PROTOCOL = 3, OS_ERROR = 4, RAISED = 5 };

typedef struct {
    int fd;
    int timeout_ms;    /* -1: wait as long as it takes */
    char *buf;         /* the reader's buffer: bytes [pos, end) received and not yet parsed */
    Py_ssize_t cap, pos, end;
    int err;           /* errno, for OS_ERROR */
    PyThreadState *ts; /* this thread's state while the GIL is released */
} Conn;

/* A value's pieces: their buffers, the Python objects they came from, and what to call with each once it is
 * whole (NULL: nothing), with the GIL, while its bytes are still in the cache. */
typedef struct {
    Py_buffer *views;
    Py_ssize_t count;
    long long nbytes;  /* the value's length: the pieces' total */
    PyObject *objects; /* a tuple */
    PyObject *filled;
} Pieces;

static int report(Conn *c, const Pieces *p, Py_ssize_t k) {
    if (p->filled == NULL)
        return OK;
    PyEval_RestoreThread(c->ts);
    PyObject *r = PyObject_CallOneArg(p->filled, PyTuple_GET_ITEM(p->objects, k));
    Py_XDECREF(r);
    c->ts = PyEval_SaveThread(); /* an exception raised stays set for the caller */
    return r == NULL ? RAISED : OK;
}

static int wait_readable(Conn *c) {
    struct pollfd p = {c->fd, POLLIN, 0};
    for (;;) {
        int r = poll(&p, 1, c->timeout_ms);
        if (r > 0)
            return OK;
        if (r == 0)
            return TIMEOUT;
        if (errno != EINTR) {
            c->err = errno;
            return OS_ERROR;
        }
    }
}

static int read_into(Conn *c, struct iovec *iov, int count, Py_ssize_t *got) {
    for (;;) {
        ssize_t r = readv(c->fd, iov, count);
        if (r > 0) {
            *got = r;
            return OK;
        }
        if (r == 0)
            return CLOSED;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) { /* a socket with a timeout is non-blocking */
            int s = wait_readable(c);
            if (s != OK)
                return s;
            continue;
        }
        c->err = errno;
        return OS_ERROR;
    }
}

/* More bytes into the buffer, after those not yet parsed (moved to the front when they reach its end). */
static int fill(Conn *c) {
    if (c->pos == c->end)
        c->pos = c->end = 0;
    else if (c->end == c->cap) {
        memmove(c->buf, c->buf + c->pos, (size_t)(c->end - c->pos));
        c->end -= c->pos;
        c->pos = 0;
    }
    if (c->end == c->cap)
        return PROTOCOL; /* cannot happen: a header is handed to Python long before */
    struct iovec v = {c->buf + c->end, (size_t)(c->cap - c->end)};
    Py_ssize_t got;
    int s = read_into(c, &v, 1, &got);
    if (s == OK)
        c->end += got;
    return s;
}

/* The length of the bulk string whose header starts at pos, and in *after where its value starts; -1 when the
 * reply there is anything else (left to Python). */
static int bulk_header(Conn *c, long long *length, Py_ssize_t *after) {
    for (;;) {
        Py_ssize_t avail = c->end - c->pos;
        const char *line = c->buf + c->pos;
        const char *cr = avail > 0 ? memchr(line, '\r', (size_t)avail) : NULL;
        if (cr != NULL && cr + 1 < c->buf + c->end) {
            Py_ssize_t n = cr - line;
            *length = -1;
            if (line[0] != '$' || n < 2 || n > 11 || cr[1] != '\n')
                return OK;
            long long v = 0;
            for (Py_ssize_t i = 1; i < n; i++) {
                if (line[i] < '0' || line[i] > '9')
                    return OK; /* "$-1", a null, among them */
                v = v * 10 + (line[i] - '0');
            }
            if (v <= MAX_BULK) {
                *length = v;
                *after = c->pos + n + 2;
            }
            return OK;
        }
        if (avail >= LONGEST_HEADER) {
            *length = -1;
            return OK;
        }
        int s = fill(c);
        if (s != OK)
            return s;
    }
}

/* A value of exactly the pieces' total length, from pos, then its CRLF; each piece reported once it is whole. */
static int land(Conn *c, const Pieces *p) {
    const Py_buffer *pieces = p->views;
    Py_ssize_t count = p->count, k = 0, off = 0;
    int s;
    while (k < count && off == pieces[k].len) { /* empty pieces */
        if ((s = report(c, p, k++)) != OK)
            return s;
    }
    while (k < count && c->pos < c->end) { /* what came in with the header */
        Py_ssize_t n = pieces[k].len - off;
        if (n > c->end - c->pos)
            n = c->end - c->pos;
        memcpy((char *)pieces[k].buf + off, c->buf + c->pos, (size_t)n);
        c->pos += n;
        off += n;
        while (k < count && off == pieces[k].len) {
            if ((s = report(c, p, k++)) != OK)
                return s;
            off = 0;
        }
    }
    while (k < count) { /* the rest straight from the socket, into up to MAX_IOV pieces a read */
        struct iovec iov[MAX_IOV];
        int m = 0;
        Py_ssize_t room = p->filled != NULL ? REPORTED_READ : PY_SSIZE_T_MAX;
        for (Py_ssize_t j = k; j < count && m < MAX_IOV && room > 0; j++) {
            Py_ssize_t start = j == k ? off : 0;
            if (pieces[j].len > start) {
                Py_ssize_t n = pieces[j].len - start < room ? pieces[j].len - start : room;
                iov[m].iov_base = (char *)pieces[j].buf + start;
                iov[m].iov_len = (size_t)n;
                room -= n;
                m++;
            }
        }
        Py_ssize_t got;
        if ((s = read_into(c, iov, m, &got)) != OK)
            return s;
        while (got > 0) {
            Py_ssize_t n = pieces[k].len - off;
            if (n > got)
                n = got;
            off += n;
            got -= n;
            while (k < count && off == pieces[k].len) {
                if ((s = report(c, p, k++)) != OK)
                    return s;
                off = 0;
            }
        }
    }
    while (c->end - c->pos < 2) {
        if ((s = fill(c)) != OK)
            return s;
    }
    if (c->buf[c->pos] != '\r' || c->buf[c->pos + 1] != '\n')
        return PROTOCOL;
    c->pos += 2;
    return OK;
}

static void release(Py_buffer *views, Py_ssize_t count, Pieces *runs, Py_ssize_t replies) {
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
    for (Py_ssize_t i = 0; i < replies; i++) {
        Py_XDECREF(runs[i].objects);
        Py_XDECREF(runs[i].filled);
    }
    PyMem_Free(views);
    PyMem_Free(runs);
}

static PyObject *receive(PyObject *self, PyObject *args) {
    int fd;
    double timeout;
    Py_buffer buffer;
    Py_ssize_t pos, end, first, stop;
    PyObject *plans, *filled;
    (void)self;
    if (!PyArg_ParseTuple(args, "idw*nnO!O!nn", &fd, &timeout, &buffer, &pos, &end, &PyList_Type, &plans,
                          &PyList_Type, &filled, &first, &stop))
        return NULL;
    if (stop > PyList_GET_SIZE(plans))
        stop = PyList_GET_SIZE(plans);
    if (pos < 0 || end < pos || end > buffer.len || first < 0 || first > stop || buffer.len < LONGEST_HEADER) {
        PyBuffer_Release(&buffer);
        PyErr_SetString(PyExc_ValueError, "receive: positions out of range");
        return NULL;
    }
    /* The run of replies with pieces to land in (a tuple each): every piece's buffer, held until the end. */
    Py_ssize_t last = first, total = 0;
    while (last < stop && PyTuple_Check(PyList_GET_ITEM(plans, last)))
        total += PyTuple_GET_SIZE(PyList_GET_ITEM(plans, last++));
    Py_buffer *views = PyMem_Calloc((size_t)(total ? total : 1), sizeof(Py_buffer));
    Pieces *runs = PyMem_Calloc((size_t)(last - first + 1), sizeof(Pieces));
    if (views == NULL || runs == NULL) {
        PyMem_Free(views);
        PyMem_Free(runs);
        PyBuffer_Release(&buffer);
        return PyErr_NoMemory();
    }
    Py_ssize_t held = 0;
    for (Py_ssize_t i = first; i < last; i++) {
        Pieces *run = &runs[i - first];
        PyObject *pieces = PyList_GET_ITEM(plans, i);
        PyObject *report = i < PyList_GET_SIZE(filled) ? PyList_GET_ITEM(filled, i) : Py_None;
        run->views = &views[held];
        run->objects = Py_NewRef(pieces);
        run->filled = report == Py_None ? NULL : Py_NewRef(report);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(pieces); j++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(pieces, j), &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                < 0) {
                release(views, held, runs, i - first + 1);
                PyBuffer_Release(&buffer);
                return NULL;
            }
            run->nbytes += views[held++].len;
            run->count++;
        }
    }

    int wait_ms = timeout < 0 ? -1 : (timeout * 1000.0 >= INT_MAX ? INT_MAX : (int)(timeout * 1000.0 + 0.999));
    Conn c = {fd, wait_ms, buffer.buf, buffer.len, pos, end, 0, NULL};
    int status = OK;
    Py_ssize_t i = first;
    c.ts = PyEval_SaveThread();
    for (; i < last; i++) {
        long long length = -1;
        Py_ssize_t after = c.pos;
        status = bulk_header(&c, &length, &after);
        if (status != OK || length != runs[i - first].nbytes)
            break; /* for Python: the reply starts at pos */
        c.pos = after;
        status = land(&c, &runs[i - first]);
        if (status != OK)
            break;
    }
    PyEval_RestoreThread(c.ts);
    release(views, held, runs, last - first);
    PyBuffer_Release(&buffer);
    if (status == RAISED)
        return NULL; /* what `filled` raised */
    return Py_BuildValue("nnnii", i, c.pos, c.end, status, c.err);
}

static PyMethodDef methods[] = {
    {"receive", receive, METH_VARARGS,
     "receive(fd, timeout, buffer, pos, end, plans, filled, first, stop) -> (next, pos, end, status, errno): "
     "replies first.. of a run whose plans[i] are tuples of writable buffers, each a bulk string of their total "
     "length landed in them in order, filled[i] (if any, and not None) called with each piece once it is whole; "
     "stops at the first other reply (left at pos, unread), at stop, or at a failure (status: 1 closed, 2 timed "
     "out, 3 no CRLF after a value, 4 errno; what filled raises is raised). timeout in seconds, negative for none"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resp", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__resp(void) { return PyModule_Create(&module); }
