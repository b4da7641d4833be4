"""The settings of the small runs that flow and end-to-end tests start: 3 prompts x 4 samples of up to 12
tokens per iteration, no early stop (the iteration count is each test's own)."""

SMALL_RUN = [
    "data.prompts_per_iteration=3",
    "sampling.group_size=4",
    "sampling.max_new_tokens=12",
    "run.early_stop_reward=null",
]


def assert_same_rows(left, right, exact: bool = True, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Two stages' rows (pandas frames in the same order) are the same; `exact=False`: floats to tolerance, list
    columns element by element too (pandas compares lists exactly whatever its tolerance), ids and texts exactly.
    A Ray worker's matrix products may sum in another order than the run's process (another thread count), so its
    logprobs may differ in the last float32 digits while every sampled token is the same."""
    import numpy as np
    import pandas as pd

    if exact:
        pd.testing.assert_frame_equal(left, right)
        return
    assert list(left.columns) == list(right.columns) and len(left) == len(right)
    for column in left.columns:
        ours, theirs = left[column], right[column]
        present = next((v for v in ours if v is not None), None)
        if not isinstance(present, list | tuple | np.ndarray):
            pd.testing.assert_series_equal(ours, theirs, check_exact=False, rtol=rtol, atol=atol)
            continue
        for row, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert (a is None) == (b is None), f"{column}[{row}]: {a!r} != {b!r}"
            if a is None:
                continue
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype.kind == "f":
                np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{column}[{row}]")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{column}[{row}]")
