/* tierkv.records._batchio: batches of record reads and writes with the GIL released for the whole batch.
 *
 * read_batch(paths, bufs, direct=False, nowait=False) -> list[int]
 * write_batch(items, fsync=False, mode=0o600, direct=False, direct_min=65536, dir_mode=None)
 *     -> (list[int], direct_writes, direct_refused)
 *
 * The semantics (open flags, results, temporary files, modes, O_DIRECT handling) are those of the
 * pure-Python tierkv/backends/batchio_py.py, which the tests run against this module item by item;
 * tierkv/backends/batchio.py documents them. Everything Python is done before and after the batch
 * (arguments parsed, paths encoded, buffers exported and held); in between, only system calls and
 * copies, on the caller's thread (the tier's own I/O threads call it, one batch each), with no
 * Python object touched.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define ALIGN 4096
#define CHUNK (4 << 20)
#define MAX_PARTS 1024 /* IOV_MAX on Linux */

#ifndef O_DIRECT
#define O_DIRECT 0
#endif

/* ---- one record's buffers as an iovec list, walked by logical offset ------------------------ */

typedef struct {
    struct iovec *iov;
    int n;
    Py_ssize_t total;
} Parts;

/* Fill out[] with the parts from logical offset `off` on; returns the count. */
static int parts_from(const Parts *p, Py_ssize_t off, struct iovec *out) {
    int k = 0;
    for (int i = 0; i < p->n; i++) {
        size_t len = p->iov[i].iov_len;
        if ((Py_ssize_t)len <= off) {
            off -= (Py_ssize_t)len;
            continue;
        }
        out[k].iov_base = (char *)p->iov[i].iov_base + off;
        out[k].iov_len = len - (size_t)off;
        off = 0;
        k++;
    }
    return k;
}

/* Copy n bytes between the parts at logical offset off and the flat buffer flat. */
static void parts_copy(const Parts *p, Py_ssize_t off, char *flat, Py_ssize_t n, int to_parts) {
    for (int i = 0; i < p->n && n > 0; i++) {
        Py_ssize_t len = (Py_ssize_t)p->iov[i].iov_len;
        if (len <= off) {
            off -= len;
            continue;
        }
        Py_ssize_t k = len - off < n ? len - off : n;
        char *at = (char *)p->iov[i].iov_base + off;
        if (to_parts)
            memcpy(at, flat, (size_t)k);
        else
            memcpy(flat, at, (size_t)k);
        flat += k;
        n -= k;
        off = 0;
    }
}

static int refused(int e) { return e == EINVAL || e == EOPNOTSUPP || e == ENOSYS; }

/* Per-thread page-aligned scratch for direct I/O, allocated on first use. */
static char *scratch_get(char **scratch) {
    if (*scratch == NULL) {
        void *p = NULL;
        if (posix_memalign(&p, ALIGN, CHUNK) != 0)
            return NULL;
        *scratch = p;
    }
    return *scratch;
}

/* The calling thread's scratch, kept across calls (a Python worker thread reads many records) and
 * freed when the thread ends. */
static pthread_key_t caller_scratch;

static void scratch_free(void *p) { free(p); }

/* ---- page-cache residency (cachestat, Linux 6.5) --------------------------------------------- */

#if defined(__linux__) && !defined(__NR_cachestat)
#define __NR_cachestat 451 /* the same number on every architecture */
#endif

struct cs_range {
    unsigned long long off, len;
};
struct cs_stat {
    unsigned long long nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

static int has_cachestat = 0; /* set at import */

/* 1 when the page cache holds every page of the first `size` bytes of fd, 0 when not, -1 when the
 * kernel cannot say (no cachestat: the caller then asks with an RWF_NOWAIT read). */
static int cached_whole(int fd, off_t size) {
#ifdef __NR_cachestat
    if (!has_cachestat)
        return -1;
    if (size <= 0)
        return 1;
    struct cs_range r = {0, (unsigned long long)size};
    struct cs_stat s;
    if (syscall(__NR_cachestat, fd, &r, &s, 0) != 0)
        return -1;
    long page = sysconf(_SC_PAGESIZE);
    return s.nr_cache >= (unsigned long long)((size + page - 1) / page);
#else
    return -1;
#endif
}

/* Every block of the new file fd at once, so the tail written after the O_DIRECT blocks lies with
 * them (tierkv/backends/fsspec/_directio.py, preallocate); nothing where the system cannot. */
static void preallocate(int fd, off_t size) {
#ifdef __linux__
    (void)fallocate(fd, 0, 0, size);
#else
    (void)fd;
    (void)size;
#endif
}

/* ---- reads ------------------------------------------------------------------------------------ */

typedef struct {
    const char *path;
    Parts parts;
    long long result;
} ReadJob;

static long long read_buffered(int fd, const Parts *p, int nowait) {
    struct iovec iov[MAX_PARTS];
    Py_ssize_t off = 0;
    while (off < p->total) {
        int k = parts_from(p, off, iov);
        ssize_t n;
#ifdef RWF_NOWAIT
        if (nowait)
            n = preadv2(fd, iov, k, off, RWF_NOWAIT);
        else
#endif
            n = preadv(fd, iov, k, off);
        if (n < 0) {
            int e = errno;
            if (e == EINTR)
                continue;
            if (nowait && e == EAGAIN)
                return -EAGAIN;
            if (nowait && refused(e))
                return -EOPNOTSUPP;
            return -e;
        }
        if (n == 0)
            break;
        off += n;
    }
    return off;
}

/* O_DIRECT: aligned chunks into the scratch, copied out; 1 when the file system refused the first
 * read (the caller then reads buffered). */
static long long read_direct(int fd, const Parts *p, char *buf, int *refuse) {
    Py_ssize_t off = 0;
    while (off < p->total) {
        Py_ssize_t want = p->total - off < CHUNK ? p->total - off : CHUNK;
        size_t ask = ((size_t)want + ALIGN - 1) & ~((size_t)ALIGN - 1);
        ssize_t n = pread(fd, buf, ask, off);
        if (n < 0) {
            int e = errno;
            if (e == EINTR)
                continue;
            if (off == 0 && refused(e)) {
                *refuse = 1;
                return 0;
            }
            return -e;
        }
        Py_ssize_t got = n < want ? n : want;
        parts_copy(p, off, buf, got, 1);
        off += got;
        if (n < (ssize_t)ask)
            break; /* end of file */
    }
    return off;
}

static long long read_one(ReadJob *j, int direct, int nowait, char **scratch) {
    int flags = O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC;
    int fd = -1;
    if (direct && O_DIRECT) {
        fd = open(j->path, flags | O_DIRECT);
        if (fd < 0 && !refused(errno))
            return -errno;
        if (fd < 0)
            direct = 0;
    } else {
        direct = 0;
    }
    if (fd < 0) {
        fd = open(j->path, flags);
        if (fd < 0)
            return -errno;
    }
    struct stat st;
    long long r;
    if (fstat(fd, &st) != 0) {
        r = -errno;
    } else if (!S_ISREG(st.st_mode)) {
        r = -ESPIPE;
    } else if (nowait && cached_whole(fd, st.st_size) == 0) {
        /* not all in the page cache: said without a read, which would start the kernel's
         * readahead here and have the caller read the same pages again (or, with O_DIRECT,
         * fetch them from the device twice) */
        r = -EAGAIN;
    } else if (direct) {
        int refuse = 0;
        char *buf = scratch_get(scratch);
        r = buf == NULL ? -ENOMEM : read_direct(fd, &j->parts, buf, &refuse);
        if (refuse) {
            int fl = fcntl(fd, F_GETFL);
            if (fl == -1 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) == -1)
                r = -errno;
            else
                r = read_buffered(fd, &j->parts, 0);
        }
    } else {
        r = read_buffered(fd, &j->parts, nowait);
    }
    close(fd);
    return r;
}

/* ---- writes ----------------------------------------------------------------------------------- */

typedef struct {
    const char *final;
    const char *tmp;
    Parts parts;
    long long result;
    int direct_used;
    int direct_refused;
} WriteJob;

typedef struct {
    int fsync;
    mode_t mode;
    mode_t dir_mode;
    int direct;
    Py_ssize_t direct_min;
    int nowait;
} Options;

static int mkdirs(char *path, mode_t mode) {
    if (mkdir(path, mode) == 0) {
        if (mode != 0700)
            chmod(path, mode); /* what the umask took from a wider mode */
        return 0;
    }
    if (errno == EEXIST)
        return 0;
    if (errno != ENOENT)
        return -1;
    char *slash = strrchr(path, '/');
    if (slash == NULL || slash == path)
        return -1;
    *slash = '\0';
    int r = mkdirs(path, mode);
    *slash = '/';
    if (r != 0)
        return -1;
    if (mkdir(path, mode) != 0 && errno != EEXIST)
        return -1;
    if (mode != 0700)
        chmod(path, mode);
    return 0;
}

static int parent_dirs(const char *file, mode_t mode) {
    char *copy = strdup(file);
    if (copy == NULL)
        return -1;
    char *slash = strrchr(copy, '/');
    int r = 0;
    if (slash != NULL && slash != copy) {
        *slash = '\0';
        r = mkdirs(copy, mode);
    }
    free(copy);
    return r;
}

static int pwrite_all(int fd, const char *data, size_t n, off_t off) {
    while (n > 0) {
        ssize_t w = pwrite(fd, data, n, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        data += w;
        n -= (size_t)w;
        off += w;
    }
    return 0;
}

static int write_buffered(int fd, const Parts *p) {
    struct iovec iov[MAX_PARTS];
    Py_ssize_t off = 0;
    while (off < p->total) {
        int k = parts_from(p, off, iov);
        ssize_t w = pwritev(fd, iov, k, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (w == 0)
            return -EIO;
        off += w;
    }
    return 0;
}

/* Whole aligned blocks with O_DIRECT from the scratch; the bytes after the last one buffered, with
 * O_DIRECT turned off on fd first, every block allocated before (what
 * tierkv/backends/fsspec/_directio.py does). */
static int write_direct(int fd, const Parts *p, char *buf) {
    Py_ssize_t done = 0;
    if (p->total % ALIGN)
        preallocate(fd, p->total);
    while (done < p->total) {
        Py_ssize_t fill = p->total - done < CHUNK ? p->total - done : CHUNK;
        parts_copy(p, done, buf, fill, 0);
        size_t aligned = (size_t)fill & ~((size_t)ALIGN - 1);
        int r = pwrite_all(fd, buf, aligned, done);
        if (r != 0)
            return r;
        if (aligned < (size_t)fill) {
            int fl = fcntl(fd, F_GETFL);
            if (fl == -1 || fcntl(fd, F_SETFL, fl & ~O_DIRECT) == -1)
                return -errno;
            r = pwrite_all(fd, buf + aligned, (size_t)fill - aligned, done + (off_t)aligned);
            if (r != 0)
                return r;
        }
        done += fill;
    }
    return 0;
}

/* The new file j->tmp with the record's bytes (removed again on any failure); 0 or -errno. */
static int write_temp(WriteJob *j, const Options *o, int direct, char **scratch) {
    int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0);
    int fd = open(j->tmp, flags, o->mode);
    if (fd < 0 && errno == ENOENT) {
        /* the directory is missing (new, or removed under us): create it and its parents */
        if (parent_dirs(j->tmp, o->dir_mode) != 0)
            return -errno;
        fd = open(j->tmp, flags, o->mode);
    }
    if (fd < 0)
        return -errno;
    if (o->mode != 0600)
        fchmod(fd, o->mode); /* what the umask took from a wider mode */
    int r;
    if (direct) {
        char *buf = scratch_get(scratch);
        r = buf == NULL ? -ENOMEM : write_direct(fd, &j->parts, buf);
    } else {
        r = write_buffered(fd, &j->parts);
    }
    if (r == 0 && o->fsync && fsync(fd) != 0)
        r = -errno;
    if (close(fd) != 0 && r == 0)
        r = -errno;
    if (r != 0)
        unlink(j->tmp);
    return r;
}

static int fsync_parent(const char *file) {
    char *copy = strdup(file);
    if (copy == NULL)
        return -ENOMEM;
    char *slash = strrchr(copy, '/');
    if (slash == copy)
        slash[1] = '\0';
    else if (slash != NULL)
        *slash = '\0';
    else
        strcpy(copy, ".");
    int r = 0;
    int dfd = open(copy, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd) != 0)
        r = -errno;
    if (dfd >= 0)
        close(dfd);
    free(copy);
    return r;
}

static long long write_one(WriteJob *j, const Options *o, char **scratch) {
    int direct = o->direct && O_DIRECT && j->parts.total >= o->direct_min;
    int r;
    if (direct) {
        r = write_temp(j, o, 1, scratch);
        if (r == 0) {
            j->direct_used = 1;
        } else if (refused(-r)) {
            j->direct_refused = 1;
            direct = 0;
        } else {
            return r;
        }
    }
    if (!direct && (r = write_temp(j, o, 0, scratch)) != 0)
        return r;
    if (rename(j->tmp, j->final) != 0) {
        r = -errno;
        unlink(j->tmp);
        j->direct_used = 0;
        return r;
    }
    if (o->fsync && (r = fsync_parent(j->final)) != 0)
        return r;
    return j->parts.total;
}

/* ---- running a batch ------------------------------------------------------------------------ */

typedef struct Batch {
    ReadJob *reads;
    WriteJob *writes;
    Py_ssize_t n;
    Options opt;
} Batch;

/* Every item in turn on the caller's thread; called with the GIL released. */
static void run_batch(Batch *b) {
    char *scratch = pthread_getspecific(caller_scratch);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->reads != NULL)
            b->reads[i].result = read_one(&b->reads[i], b->opt.direct, b->opt.nowait, &scratch);
        else
            b->writes[i].result = write_one(&b->writes[i], &b->opt, &scratch);
    }
    pthread_setspecific(caller_scratch, scratch);
}

/* ---- arguments -------------------------------------------------------------------------------- */

typedef struct {
    PyObject **paths; /* bytes objects from PyUnicode_FSConverter */
    Py_ssize_t npaths;
    Py_buffer *views;
    Py_ssize_t nviews;
    Py_ssize_t cap; /* room in views and iov */
    struct iovec *iov;
} Held;

static void held_free(Held *h) {
    for (Py_ssize_t i = 0; i < h->npaths; i++)
        Py_XDECREF(h->paths[i]);
    for (Py_ssize_t i = 0; i < h->nviews; i++)
        PyBuffer_Release(&h->views[i]);
    PyMem_Free(h->paths);
    PyMem_Free(h->views);
    PyMem_Free(h->iov);
}

static const char *held_path(Held *h, PyObject *obj) {
    PyObject *enc = NULL;
    if (!PyUnicode_FSConverter(obj, &enc))
        return NULL;
    h->paths[h->npaths++] = enc;
    return PyBytes_AS_STRING(enc);
}

/* Count the buffers of one item: a buffer, or a list/tuple of buffers. */
static Py_ssize_t count_parts(PyObject *item) {
    if (PyList_Check(item) || PyTuple_Check(item))
        return PySequence_Fast_GET_SIZE(item);
    return 1;
}

/* Export the buffers of `item` into h (held until held_free) and describe them in *p. A list is
 * copied first: exporting a buffer may run Python code (__buffer__, __fspath__ of another item)
 * that changes it. */
static int held_parts(Held *h, PyObject *item, int writable, Py_ssize_t index, Parts *p) {
    PyObject *seq = NULL;
    PyObject **objs = &item;
    Py_ssize_t n = 1;
    int r = -1;
    if (PyList_Check(item) || PyTuple_Check(item)) {
        if ((seq = PySequence_Tuple(item)) == NULL)
            return -1;
        objs = &PyTuple_GET_ITEM(seq, 0);
        n = PyTuple_GET_SIZE(seq);
    }
    if (n > MAX_PARTS) {
        PyErr_Format(PyExc_ValueError, "item %zd has %zd buffers; at most %d", index, n, MAX_PARTS);
        goto out;
    }
    if (n > h->cap - h->nviews) {
        PyErr_Format(PyExc_RuntimeError, "item %zd: the buffer lists changed during the call", index);
        goto out;
    }
    p->iov = h->iov + h->nviews;
    p->n = (int)n;
    p->total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_buffer *v = &h->views[h->nviews];
        if (PyObject_GetBuffer(objs[k], v, PyBUF_SIMPLE) != 0) {
            if (PyObject_CheckBuffer(objs[k]) &&
                (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError))) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "item %zd: buffers must be C-contiguous", index);
            }
            goto out;
        }
        h->nviews++;
        if (writable && v->readonly) {
            PyErr_Format(PyExc_TypeError, "item %zd: a read needs writable buffers, got a read-only %.80s",
                         index, Py_TYPE(objs[k])->tp_name);
            goto out;
        }
        p->iov[k].iov_base = v->buf;
        p->iov[k].iov_len = (size_t)v->len;
        p->total += v->len;
    }
    r = 0;
out:
    Py_XDECREF(seq);
    return r;
}

static int held_alloc(Held *h, Py_ssize_t npaths, Py_ssize_t nviews) {
    memset(h, 0, sizeof(*h));
    h->paths = PyMem_Calloc((size_t)npaths + 1, sizeof(PyObject *));
    h->views = PyMem_Calloc((size_t)nviews + 1, sizeof(Py_buffer));
    h->iov = PyMem_Calloc((size_t)nviews + 1, sizeof(struct iovec));
    h->cap = nviews;
    if (h->paths == NULL || h->views == NULL || h->iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* ---- read_batch ------------------------------------------------------------------------------- */

PyDoc_STRVAR(read_batch_doc,
"read_batch(paths, bufs, direct=False, nowait=False) -> list[int]\n\n"
"Read each file into its buffers (a writable buffer, or a list of them filled in order); per item\n"
"the bytes read (less than the buffers hold: the file ended) or -errno. See tierkv.records.batchio.");

static PyObject *read_batch(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"paths", "bufs", "direct", "nowait", NULL};
    PyObject *paths_obj, *bufs_obj;
    int direct = 0, nowait = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|pp:read_batch", names, &paths_obj, &bufs_obj, &direct,
                                     &nowait))
        return NULL;
    PyObject *paths = PySequence_Tuple(paths_obj); /* copies: see held_parts */
    if (paths == NULL)
        return NULL;
    PyObject *bufs = PySequence_Tuple(bufs_obj);
    if (bufs == NULL) {
        Py_DECREF(paths);
        return NULL;
    }
    PyObject *out = NULL;
    ReadJob *jobs = NULL;
    Held h;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths);
    Py_ssize_t nviews = 0;
    memset(&h, 0, sizeof(h));
    if (PySequence_Fast_GET_SIZE(bufs) != n) {
        PyErr_Format(PyExc_ValueError, "%zd paths but %zd buffers", n, PySequence_Fast_GET_SIZE(bufs));
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        nviews += count_parts(PySequence_Fast_GET_ITEM(bufs, i));
    if (held_alloc(&h, n, nviews) != 0)
        goto done;
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(ReadJob));
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((jobs[i].path = held_path(&h, PySequence_Fast_GET_ITEM(paths, i))) == NULL)
            goto done;
        if (held_parts(&h, PySequence_Fast_GET_ITEM(bufs, i), 1, i, &jobs[i].parts) != 0)
            goto done;
    }
    Batch b = {.reads = jobs, .n = n, .opt = {.direct = direct, .nowait = nowait}};
    Py_BEGIN_ALLOW_THREADS
    run_batch(&b);
    Py_END_ALLOW_THREADS
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(jobs[i].result);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    held_free(&h);
    PyMem_Free(jobs);
    Py_DECREF(paths);
    Py_DECREF(bufs);
    return out;
}

/* ---- write_batch ------------------------------------------------------------------------------ */

PyDoc_STRVAR(write_batch_doc,
"write_batch(items, fsync=False, mode=0o600, direct=False, direct_min=65536, dir_mode=None)\n"
"    -> (list[int], direct_writes, direct_refused)\n\n"
"Publish each (final_path, tmp_path, buffers) atomically: write tmp_path, then rename it to\n"
"final_path; per item the bytes written or -errno. See tierkv.records.batchio.");

static PyObject *write_batch(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"items", "fsync", "mode", "direct", "direct_min", "dir_mode", NULL};
    PyObject *items_obj, *dir_mode_obj = Py_None;
    int fsync_ = 0, direct = 0, mode = 0600;
    Py_ssize_t direct_min = 65536;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pipnO:write_batch", names, &items_obj, &fsync_, &mode,
                                     &direct, &direct_min, &dir_mode_obj))
        return NULL;
    if (mode < 0 || mode > 07777) {
        PyErr_Format(PyExc_ValueError, "mode must be a permission mode, got %d", mode);
        return NULL;
    }
    long dir_mode = mode | ((mode & 0444) >> 2);
    if (dir_mode_obj != Py_None) {
        dir_mode = PyLong_AsLong(dir_mode_obj);
        if (dir_mode == -1 && PyErr_Occurred())
            return NULL;
        if (dir_mode < 0 || dir_mode > 07777) {
            PyErr_Format(PyExc_ValueError, "dir_mode must be a permission mode, got %ld", dir_mode);
            return NULL;
        }
    }
    PyObject *items = PySequence_Tuple(items_obj); /* a copy: see held_parts */
    if (items == NULL)
        return NULL;
    PyObject *out = NULL, *sizes = NULL;
    WriteJob *jobs = NULL;
    Held h;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    Py_ssize_t nviews = 0;
    memset(&h, 0, sizeof(h));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(items, i);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 3) {
            PyErr_Format(PyExc_TypeError, "item %zd must be a tuple (final_path, tmp_path, buffers)", i);
            goto done;
        }
        nviews += count_parts(PyTuple_GET_ITEM(it, 2));
    }
    if (held_alloc(&h, 2 * n, nviews) != 0)
        goto done;
    jobs = PyMem_Calloc((size_t)n + 1, sizeof(WriteJob));
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PySequence_Fast_GET_ITEM(items, i);
        if ((jobs[i].final = held_path(&h, PyTuple_GET_ITEM(it, 0))) == NULL)
            goto done;
        if ((jobs[i].tmp = held_path(&h, PyTuple_GET_ITEM(it, 1))) == NULL)
            goto done;
        if (held_parts(&h, PyTuple_GET_ITEM(it, 2), 0, i, &jobs[i].parts) != 0)
            goto done;
    }
    Batch b = {.writes = jobs, .n = n,
               .opt = {.fsync = fsync_, .mode = (mode_t)mode, .dir_mode = (mode_t)dir_mode,
                       .direct = direct, .direct_min = direct_min}};
    Py_BEGIN_ALLOW_THREADS
    run_batch(&b);
    Py_END_ALLOW_THREADS
    if ((sizes = PyList_New(n)) == NULL)
        goto done;
    long used = 0, refused_n = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLongLong(jobs[i].result);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(sizes, i, v);
        used += jobs[i].direct_used;
        refused_n += jobs[i].direct_refused;
    }
    out = Py_BuildValue("(Oll)", sizes, used, refused_n);
done:
    Py_XDECREF(sizes);
    held_free(&h);
    PyMem_Free(jobs);
    Py_DECREF(items);
    return out;
}

static PyMethodDef methods[] = {
    {"read_batch", (PyCFunction)(void (*)(void))read_batch, METH_VARARGS | METH_KEYWORDS, read_batch_doc},
    {"write_batch", (PyCFunction)(void (*)(void))write_batch, METH_VARARGS | METH_KEYWORDS, write_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierkv.records._batchio",
    "Batches of record reads and writes in C, the GIL released for the whole batch.", -1, methods,
};

PyMODINIT_FUNC PyInit__batchio(void) {
    static int ready = 0;
    if (!ready) {
        if (pthread_key_create(&caller_scratch, scratch_free) != 0)
            return PyErr_Format(PyExc_OSError, "pthread_key_create failed");
#ifdef __NR_cachestat
        struct cs_range r = {0, 0};
        struct cs_stat s;
        has_cachestat = syscall(__NR_cachestat, -1, &r, &s, 0) != 0 && errno == EBADF;
#endif
        ready = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ALIGN", ALIGN) != 0 || PyModule_AddIntConstant(m, "CHUNK_BYTES", CHUNK) != 0
        || PyModule_AddIntConstant(m, "CACHESTAT", has_cachestat) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
