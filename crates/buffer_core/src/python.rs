//! The only pyo3 file: exposes the buffer core as `asyncrl_core._buffer_core`.

use pyo3::prelude::*;

#[pymodule]
fn _buffer_core(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
