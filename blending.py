"""megatron-core BlendedDataset's blending indices (its C++ build_blending_indices and
build_exhaustive_blending_indices), bit for bit, in numpy; tests/test_indexed_megatron.py compares them at scale."""
import numpy as np

# blending_indices works in chunks of CHUNK steps, each started WARM_UP steps early from a guess; one numpy operation
# handles at most SIDE_BY_SIDE_CELLS datasets x chunks, which keeps its arrays in the CPU cache
CHUNK, WARM_UP, SIDE_BY_SIDE_CELLS = 512, 64, 1 << 17


def blending_indices(weights, size=None):
    """megatron-core BlendedDataset's (dataset_index int16, dataset_sample_index int64).

    With `size`: `size` draws where step s takes the dataset d maximising weights[d] * max(s, 1) - draws[d] (the
    first on ties), in float64 exactly as megatron's C++ does. Without: `weights` are integer sample counts, which
    are drawn exactly (a dataset drops out once used up), with weights = counts / sum(counts).

    The greedy is sequential and 10M Python steps are too slow, so it runs in chunks of steps side by side, one numpy
    operation advancing every chunk by a step. Each chunk starts from a guess of the draws before its first step:
    weights * step rounded by largest remainder, WARM_UP steps earlier, then the greedy run up to the chunk (it
    forgets where it started within a few dozen steps). A chunk whose start differs from where the chunk before it
    really ended is run again from there, until none differs, so the result is exact whatever the guesses.
    """
    if size is None:
        quotas = np.asarray(weights, dtype=np.int64)
        size = int(quotas.sum())
        weights = quotas / float(size)
    else:
        quotas = None
        weights = np.asarray(weights, dtype=np.float64)
    num_chunks = -(-size // CHUNK)
    first_steps = np.arange(num_chunks, dtype=np.int64) * CHUNK
    start_draws = np.zeros((num_chunks, len(weights)), dtype=np.int64)  # exact for chunk 0
    guess_steps = first_steps[1:] - WARM_UP
    guess = _largest_remainder(weights * (guess_steps - 1)[:, None], guess_steps)
    if quotas is not None:
        np.minimum(guess, quotas, out=guess)
    start_draws[1:] = _greedy(weights, quotas, guess_steps, guess, WARM_UP)

    dataset_index = np.empty((num_chunks, CHUNK), dtype=np.int16)
    dataset_sample_index = np.empty((num_chunks, CHUNK), dtype=np.int64)
    end_draws = np.empty_like(start_draws)
    todo = np.arange(num_chunks)
    while todo.size:
        end_draws[todo] = _greedy(weights, quotas, first_steps[todo], start_draws[todo], CHUNK,
                                  (dataset_index, dataset_sample_index, todo))
        todo = np.flatnonzero((start_draws[1:] != end_draws[:-1]).any(axis=1)) + 1
        start_draws[todo] = end_draws[todo - 1]
    return dataset_index.reshape(-1)[:size], dataset_sample_index.reshape(-1)[:size]


def _largest_remainder(ideal, totals):
    """Integer rows near `ideal` that add up to `totals`: floors, plus one for the largest fractional parts."""
    counts = np.floor(ideal).astype(np.int64)
    missing = totals - counts.sum(axis=1)
    rank = np.argsort(np.argsort(counts - ideal, axis=1, kind="stable"), axis=1, kind="stable")
    return counts + (rank < missing[:, None])


def _greedy(weights, quotas, first_steps, draws, steps, record=None):
    """The draws after running the blending greedy for `steps` steps from each row of `draws` (the draws before
    step `first_steps[row]`). With record = (dataset_index, dataset_sample_index, rows), step t of row i is written to
    column t of row rows[i] of both."""
    num_datasets = len(weights)
    weight_column = weights[:, None]
    quota_column = None if quotas is None else quotas[:, None]
    first_on_ties = (num_datasets - np.arange(num_datasets, dtype=np.int16))[:, None]
    end_draws = np.empty_like(draws)
    per_group = max(1, SIDE_BY_SIDE_CELLS // num_datasets)  # keeps each operation's arrays in the CPU cache
    for group_start in range(0, len(draws), per_group):
        group = slice(group_start, group_start + per_group)
        chunks = len(draws[group])
        counts = np.ascontiguousarray(draws[group].T, dtype=np.float64)  # (datasets, chunks): reduce along rows
        flat_counts = counts.reshape(-1)
        columns = np.arange(chunks)
        if record is not None:
            rows = record[2][group]
            in_place = rows[-1] - rows[0] + 1 == chunks  # consecutive rows: write straight into the output
            picks = record[0][rows[0]:rows[-1] + 1] if in_place else np.empty((chunks, steps), np.int16)
            samples = record[1][rows[0]:rows[-1] + 1] if in_place else np.empty((chunks, steps), np.int64)
        step = np.empty(chunks)
        error = np.empty((num_datasets, chunks))
        largest = np.empty(chunks)
        is_largest = np.empty((num_datasets, chunks), dtype=bool)
        ranked = np.empty((num_datasets, chunks), dtype=np.int16)
        for t in range(steps):
            np.add(first_steps[group], t, out=step)
            np.maximum(step, 1.0, out=step)
            np.multiply(weight_column, step, out=error)
            np.subtract(error, counts, out=error)
            if quota_column is not None:
                np.putmask(error, counts >= quota_column, -np.inf)
            if num_datasets == 2:
                pick = (error[1] > error[0]).astype(np.int64)
            else:  # argmax over datasets, first on ties; np.argmax along axis 0 is several times slower
                np.max(error, axis=0, out=largest)
                np.equal(error, largest, out=is_largest)
                np.multiply(is_largest, first_on_ties, out=ranked)
                pick = num_datasets - ranked.max(axis=0).astype(np.int64)
            where = pick * chunks + columns
            if record is not None:
                picks[:, t] = pick
                samples[:, t] = flat_counts[where]
            flat_counts[where] += 1
        if record is not None and not in_place:
            record[0][rows], record[1][rows] = picks, samples
        end_draws[group] = counts.T
    return end_draws
