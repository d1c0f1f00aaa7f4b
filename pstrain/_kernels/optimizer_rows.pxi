# Included by compiled.pyx: the sparse optimizer steps, each row in one pass (SGD, Adagrad,
# row-wise Adagrad), bit for bit the reference's arithmetic.

def sgd_rows(real[:, ::1] var, const int64_t[::1] rows, const real[:, ::1] g, real lr):
    """``var[rows[i]] -= lr * g[i]`` for each ``rows[i] >= 0`` (unique), in one pass."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef bint bad = False
    with nogil:
        for i in range(n):
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            for j in range(dim):
                var[r, j] = var[r, j] - lr * g[i, j]
    if bad:
        raise IndexError("sgd_rows: a row past the variable's end")


def adagrad_rows(real[:, ::1] var, real[:, ::1] acc, const int64_t[::1] rows,
                 const real[:, ::1] g, real lr, real eps):
    """Adagrad on the rows ``rows[i] >= 0`` (unique): gather row and accumulator, update,
    write back, one pass; the arithmetic of the numpy rule, in the variable's dtype."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef real gj, a
    cdef bint bad = False
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    with nogil:
        for i in range(n):
            if i + AHEAD < n and 0 <= rows[i + AHEAD] < limit:
                _prefetch(<const char*>&var[rows[i + AHEAD], 0], row_bytes)
                _prefetch(<const char*>&acc[rows[i + AHEAD], 0], row_bytes)
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            for j in range(dim):
                gj = g[i, j]
                a = acc[r, j] + gj * gj
                acc[r, j] = a
                if real is float:
                    var[r, j] = var[r, j] - (lr * gj) / sqrtf(a + eps)
                else:
                    var[r, j] = var[r, j] - (lr * gj) / sqrt(a + eps)
    if bad:
        raise IndexError("adagrad_rows: a row past the variable's end")


def rowwise_adagrad_rows(real[:, ::1] var, real[:, ::1] acc, const int64_t[::1] rows,
                         const real[:, ::1] g, real lr, real eps):
    """Row-wise Adagrad (TorchRec's default) on the rows ``rows[i] >= 0`` (unique): one
    accumulator per row grows by the mean of the squared gradient over the row (``acc``:
    one column, or as wide as ``var`` with every column holding it);
    ``var -= lr / (sqrt(acc) + eps) * g``."""
    cdef Py_ssize_t i, j, r, n = rows.shape[0], dim = var.shape[1], limit = var.shape[0]
    cdef Py_ssize_t width = acc.shape[1]
    cdef real s, a, step
    cdef bint bad = False
    cdef Py_ssize_t row_bytes = dim * sizeof(real)
    if acc.shape[0] < limit or (width != 1 and width != dim):
        raise ValueError("rowwise_adagrad_rows: acc is not one column, or var's width, per row")
    with nogil:
        for i in range(n):
            if i + AHEAD < n and 0 <= rows[i + AHEAD] < limit:
                _prefetch(<const char*>&var[rows[i + AHEAD], 0], row_bytes)
            r = rows[i]
            if r < 0:
                continue
            if r >= limit:
                bad = True
                break
            s = 0
            for j in range(dim):
                s = s + g[i, j] * g[i, j]
            s = s / <real>dim
            a = acc[r, 0] + s
            for j in range(width):
                acc[r, j] = a
            if real is float:
                step = lr / (sqrtf(a) + eps)
            else:
                step = lr / (sqrt(a) + eps)
            for j in range(dim):
                var[r, j] = var[r, j] - step * g[i, j]
    if bad:
        raise IndexError("rowwise_adagrad_rows: a row past the variable's end")
