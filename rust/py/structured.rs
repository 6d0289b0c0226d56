//! Structured outputs: grammar vocabularies, per-sequence grammar states and
//! the batched mask the CPU sampler applies (`rust/structured.rs`).

use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::tensor::{DType, TensorArg};
use crate::structured::{self, Constraint, GrammarState, Vocabulary};

/// A constraint from its kind and value, as `SamplingParams` holds them.
fn constraint(kind: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Constraint> {
    let text = |what: &str| -> PyResult<String> {
        value
            .ok_or_else(|| PyValueError::new_err(format!("{what}: needs a value")))?
            .extract::<String>()
            .map_err(|_| PyValueError::new_err(format!("{what}: must be a string")))
    };
    Ok(match kind {
        "json" => Constraint::JsonSchema(text("json")?),
        "json_object" => Constraint::JsonObject,
        "regex" => Constraint::Regex(text("regex")?),
        "grammar" => Constraint::Grammar(text("grammar")?),
        "choice" => Constraint::Choice(
            value
                .ok_or_else(|| PyValueError::new_err("choice: needs a list of strings"))?
                .extract::<Vec<String>>()
                .map_err(|_| PyValueError::new_err("choice: must be a list of strings"))?,
        ),
        other => {
            return Err(PyValueError::new_err(format!(
            "unknown structured output kind {other:?} (json, json_object, regex, choice, grammar)"
        )))
        }
    })
}

/// Checks that a constraint compiles (no tokenizer needed); a ValueError
/// naming the field (and a JSON schema's path) if it does not.
#[pyfunction]
#[pyo3(signature = (kind, value=None, whitespace_flexible=true))]
fn validate_structured(
    py: Python<'_>,
    kind: &str,
    value: Option<&Bound<'_, PyAny>>,
    whitespace_flexible: bool,
) -> PyResult<()> {
    let c = constraint(kind, value)?;
    Ok(py.detach(|| structured::validate(&c, whitespace_flexible))?)
}

/// One tokenizer's token trie and grammar compiler (built once per process
/// per tokenizer, then shared), with its cache of compiled grammars.
#[pyclass(name = "GrammarVocabulary", module = "fastllm._core", frozen)]
pub(crate) struct PyVocabulary {
    inner: Arc<Vocabulary>,
}

#[pymethods]
impl PyVocabulary {
    #[new]
    #[pyo3(signature = (tokenizer_json, eos_token_ids, vocab_size))]
    fn new(
        py: Python<'_>,
        tokenizer_json: &[u8],
        eos_token_ids: Vec<u32>,
        vocab_size: usize,
    ) -> PyResult<PyVocabulary> {
        let json = tokenizer_json.to_vec();
        let inner =
            py.detach(|| Vocabulary::from_tokenizer_json(&json, &eos_token_ids, vocab_size))?;
        Ok(PyVocabulary { inner })
    }

    /// Number of token ids (the model's logits per row).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// How many compiled grammars are cached.
    #[getter]
    fn cached_grammars(&self) -> usize {
        self.inner.cached_grammars()
    }

    /// The byte string of a token (special tokens start with 0xFF).
    fn token_bytes<'py>(&self, py: Python<'py>, token: u32) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.token_bytes(token))
    }

    /// A fresh grammar state for a constraint (compiled on first use, then cached).
    #[pyo3(signature = (kind, value=None, whitespace_flexible=true))]
    fn start(
        &self,
        py: Python<'_>,
        kind: &str,
        value: Option<&Bound<'_, PyAny>>,
        whitespace_flexible: bool,
    ) -> PyResult<GrammarMatcher> {
        let c = constraint(kind, value)?;
        let inner = self.inner.clone();
        let state = py.detach(move || inner.start(&c, whitespace_flexible))?;
        Ok(GrammarMatcher { state })
    }
}

/// One sequence's position in its grammar.
#[pyclass(name = "GrammarMatcher", module = "fastllm._core")]
pub(crate) struct GrammarMatcher {
    state: GrammarState,
}

#[pymethods]
impl GrammarMatcher {
    /// Advances by one token; a ValueError if the grammar does not allow it.
    fn consume(&mut self, token: u32) -> PyResult<()> {
        Ok(self.state.consume(token)?)
    }

    /// Steps back over the last `n` consumed tokens.
    fn rollback(&mut self, n: usize) -> PyResult<()> {
        Ok(self.state.rollback(n)?)
    }

    /// An independent copy at the same position.
    fn fork(&self) -> PyResult<GrammarMatcher> {
        Ok(GrammarMatcher {
            state: self.state.fork()?,
        })
    }

    /// The token ids allowed next, ascending (EOS exactly when the grammar accepts).
    fn allowed_tokens(&mut self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let state = &mut self.state;
        Ok(py.detach(|| state.mask().map(|m| m.to_list()))?)
    }

    /// Whether the text so far is a complete match.
    fn is_accepting(&mut self) -> bool {
        self.state.is_accepting()
    }

    /// Whether nothing but EOS may follow (complete, or failed).
    #[getter]
    fn is_finished(&self) -> bool {
        self.state.is_finished()
    }

    /// Tokens consumed so far.
    #[getter]
    fn num_consumed(&self) -> usize {
        self.state.num_consumed()
    }

    /// The grammar engine's error, if it met one.
    #[getter]
    fn error(&self) -> Option<String> {
        self.state.error()
    }
}

/// Writes -inf into the disallowed logits of each row `rows[i]` of float32
/// CPU logits `[R, V]`, for the grammar state `matchers[i]` (in place; the
/// rows' masks are computed in parallel).
#[pyfunction]
fn apply_grammar_masks(
    py: Python<'_>,
    logits: &Bound<'_, PyAny>,
    rows: Vec<usize>,
    matchers: Vec<PyRefMut<'_, GrammarMatcher>>,
) -> PyResult<()> {
    let logits = TensorArg::extract("logits", logits)?;
    logits.check(&[DType::F32], 2)?;
    let vocab = logits.shape[1];
    let mut matchers = matchers;
    let mut states: Vec<&mut GrammarState> = matchers.iter_mut().map(|m| &mut m.state).collect();
    // SAFETY: checked just above (CPU, float32, contiguous); nothing else
    // touches the tensor while the GIL is released for this call.
    let values = unsafe { logits.slice_mut::<f32>() };
    Ok(py.detach(|| structured::apply_masks(values, vocab, &rows, &mut states))?)
}

/// The allowed tokens of each grammar state (EOS alone for a failed one) as
/// a bitmask: `len(matchers)` rows of `ceil(vocab / 32)` little-endian int32
/// words (token i at bit i % 32 of word i / 32), the layout the CUDA
/// sampler's mask uses.
#[pyfunction]
fn grammar_bitmask<'py>(
    py: Python<'py>,
    matchers: Vec<PyRefMut<'py, GrammarMatcher>>,
    vocab: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    use rayon::prelude::*;
    let mut matchers = matchers;
    let states: Vec<&mut GrammarState> = matchers.iter_mut().map(|m| &mut m.state).collect();
    let words = py.detach(|| {
        crate::cpu::threads::install(|| {
            states
                .into_par_iter()
                .map(|st| structured::mask_words(&st.mask_or_end(), vocab))
                .collect::<Vec<Vec<u32>>>()
        })
    });
    let bytes: Vec<u8> = words
        .iter()
        .flatten()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    Ok(PyBytes::new(py, &bytes))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyVocabulary>()?;
    m.add_class::<GrammarMatcher>()?;
    m.add_function(wrap_pyfunction!(validate_structured, m)?)?;
    m.add_function(wrap_pyfunction!(apply_grammar_masks, m)?)?;
    m.add_function(wrap_pyfunction!(grammar_bitmask, m)?)?;
    Ok(())
}
