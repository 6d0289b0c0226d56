//! The mixture-of-experts layers (`moe`): the router (`moe_route`) and the
//! grouped expert FFN (`MoeExperts`), whose experts are `PackedLinear` /
//! `QuantizedLinear` weights, shared, not copied.

use std::sync::Arc;

use half::bf16;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::linear::linear_weight;
use super::tensor::{check_no_overlap, DType, TensorArg};
use crate::linear::LinearWeight;
use crate::moe::{route, ExpertAct, Experts, Rule, Scoring, SharedExpert, SparseMlp};

/// A scoring by name; a ValueError naming the argument otherwise.
fn parse_scoring(scoring: &str) -> PyResult<Scoring> {
    Scoring::parse(scoring).ok_or_else(|| {
        let names: Vec<&str> = Scoring::ALL.iter().map(|s| s.name()).collect();
        PyValueError::new_err(format!(
            "scoring: unknown value '{scoring}', expected one of {names:?}"
        ))
    })
}

/// Writes each token's `top_k = ids.shape[1]` best experts into `ids`
/// (int32 [T, k]) and their weights into `weights` (float32 [T, k]), from
/// `logits` (float32 [T, E]); `scoring` "softmax" or "sigmoid"; the choice
/// made on `score + selection_bias[e]` where given (the weights stay the
/// scores), the weights divided by `sum + renorm_eps` when `renormalize`,
/// then multiplied by `scale` (`moe::Rule`).
#[pyfunction]
#[pyo3(signature = (ids, weights, logits, scoring="softmax", renormalize=true,
                    selection_bias=None, renorm_eps=0.0, scale=1.0))]
#[allow(clippy::too_many_arguments)]
fn moe_route(
    py: Python<'_>,
    ids: &Bound<'_, PyAny>,
    weights: &Bound<'_, PyAny>,
    logits: &Bound<'_, PyAny>,
    scoring: &str,
    renormalize: bool,
    selection_bias: Option<Vec<f32>>,
    renorm_eps: f32,
    scale: f32,
) -> PyResult<()> {
    let scoring = parse_scoring(scoring)?;
    let logits = TensorArg::extract("logits", logits)?;
    logits.check(&[DType::F32], 2)?;
    let (tokens, experts) = (logits.shape[0], logits.shape[1]);
    let ids = TensorArg::extract("ids", ids)?;
    ids.check(&[DType::I32], 2)?;
    ids.expect_dim(0, tokens, "tokens of logits")?;
    let top_k = ids.shape[1];
    let rule = Rule {
        renorm_eps,
        scale,
        bias: selection_bias,
        ..Rule::new(top_k, scoring, renormalize)
    };
    if top_k == 0 || top_k > experts {
        return Err(PyValueError::new_err(format!(
            "ids: its {top_k} columns (top_k) must be between 1 and the {experts} experts of logits"
        )));
    }
    let weights = TensorArg::extract("weights", weights)?;
    weights.check(&[DType::F32], 2)?;
    weights.expect_dim(0, tokens, "tokens of logits")?;
    weights.expect_dim(1, top_k, "columns of ids")?;
    check_no_overlap(&ids, &logits)?;
    check_no_overlap(&weights, &logits)?;
    check_no_overlap(&weights, &ids)?;
    // SAFETY: the three were checked (dtype, CPU, contiguity, shape) and
    // share no memory; the caller keeps them alive.
    let (l, i, w) = unsafe {
        (
            logits.slice::<f32>(),
            ids.slice_mut::<i32>(),
            weights.slice_mut::<f32>(),
        )
    };
    py.detach(move || route(l, tokens, experts, &rule, i, w))?;
    Ok(())
}

/// The experts of one MoE layer, run on grouped tokens.
#[pyclass(name = "MoeExperts", module = "fastllm._core", frozen)]
struct PyMoeExperts {
    experts: Arc<Experts>,
}

/// The experts of a `MoeExperts` object (shared, for the decoder stack).
pub(super) fn experts_of(obj: &Bound<'_, PyAny>) -> PyResult<Arc<Experts>> {
    let experts = obj
        .cast::<PyMoeExperts>()
        .map_err(|_| PyValueError::new_err("experts: expected a MoeExperts"))?;
    Ok(experts.get().experts.clone())
}

/// The gated activation called `activation` (`alpha`, `limit`: gpt-oss's).
pub(super) fn parse_act(activation: &str, alpha: f32, limit: f32) -> PyResult<ExpertAct> {
    match activation.trim().to_ascii_lowercase().as_str() {
        "silu" => Ok(ExpertAct::Silu),
        "gelu_tanh" => Ok(ExpertAct::GeluTanh),
        "swiglu_oai" => Ok(ExpertAct::SwigluOai { alpha, limit }),
        _ => Err(PyValueError::new_err(format!(
            "activation: unknown value '{activation}', expected one of \
             ['silu', 'gelu_tanh', 'swiglu_oai']"
        ))),
    }
}

fn weights_of(items: &[Bound<'_, PyAny>], name: &str) -> PyResult<Vec<LinearWeight>> {
    items
        .iter()
        .enumerate()
        .map(|(e, w)| linear_weight(w, &format!("{name}[{e}]")))
        .collect()
}

#[pymethods]
impl PyMoeExperts {
    /// `gate_up`: per expert a linear [2I, H] (gate rows, then up rows);
    /// `down`: per expert a linear [H, I]; `activation` "silu", "gelu_tanh"
    /// or "swiglu_oai" (gpt-oss, with `alpha` and `limit`).
    #[new]
    #[pyo3(signature = (gate_up, down, activation="silu", alpha=1.702, limit=7.0))]
    fn new(
        gate_up: Vec<Bound<'_, PyAny>>,
        down: Vec<Bound<'_, PyAny>>,
        activation: &str,
        alpha: f32,
        limit: f32,
    ) -> PyResult<Self> {
        let act = parse_act(activation, alpha, limit)?;
        let gate_up = weights_of(&gate_up, "gate_up")?;
        let down = weights_of(&down, "down")?;
        Ok(PyMoeExperts {
            experts: Arc::new(Experts::new(gate_up, down, act)?),
        })
    }

    /// out [T, H] = sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]):
    /// out and x bf16 or f32 (one dtype), ids int32 [T, k], weights
    /// float32 [T, k]. Releases the GIL.
    fn forward(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let h = self.experts.hidden();
        let x = TensorArg::extract("x", x)?;
        x.check(&[DType::BF16, DType::F32], 2)?;
        x.expect_dim(1, h, "hidden_size")?;
        let tokens = x.shape[0];
        let out = TensorArg::extract("out", out)?;
        out.check(&[x.dtype], 2)?;
        out.expect_dim(0, tokens, "tokens of x")?;
        out.expect_dim(1, h, "hidden_size")?;
        let ids = TensorArg::extract("ids", ids)?;
        ids.check(&[DType::I32], 2)?;
        ids.expect_dim(0, tokens, "tokens of x")?;
        let top_k = ids.shape[1];
        let weights = TensorArg::extract("weights", weights)?;
        weights.check(&[DType::F32], 2)?;
        weights.expect_dim(0, tokens, "tokens of x")?;
        weights.expect_dim(1, top_k, "columns of ids")?;
        for other in [&x, &ids, &weights] {
            check_no_overlap(&out, other)?;
        }
        let ex = &self.experts;
        // SAFETY: every tensor was checked (dtype, CPU, contiguity, shape)
        // and out shares no memory with the inputs; the caller keeps them
        // alive.
        unsafe {
            let (i, w) = (ids.slice::<i32>(), weights.slice::<f32>());
            match x.dtype {
                DType::BF16 => {
                    let (o, xs) = (out.slice_mut::<bf16>(), x.slice::<bf16>());
                    py.detach(move || ex.forward(o, xs, i, w, tokens, top_k))?
                }
                _ => {
                    let (o, xs) = (out.slice_mut::<f32>(), x.slice::<f32>());
                    py.detach(move || ex.forward(o, xs, i, w, tokens, top_k))?
                }
            }
        }
        Ok(())
    }

    #[getter]
    fn num_experts(&self) -> usize {
        self.experts.num_experts()
    }

    #[getter]
    fn hidden_size(&self) -> usize {
        self.experts.hidden()
    }

    #[getter]
    fn intermediate_size(&self) -> usize {
        self.experts.intermediate()
    }

    /// Bytes of every expert's packed weights (and scales).
    #[getter]
    fn nbytes(&self) -> usize {
        self.experts.nbytes()
    }

    /// The kernel path of the first expert.
    #[getter]
    fn path(&self) -> &'static str {
        self.experts.gate_up[0].path_name()
    }

    fn __repr__(&self) -> String {
        format!(
            "MoeExperts(num_experts={}, hidden_size={}, intermediate_size={}, activation={}, path={})",
            self.num_experts(),
            self.hidden_size(),
            self.intermediate_size(),
            self.experts.act.name(),
            self.path()
        )
    }
}

/// A whole mixture-of-experts block in one call: router, routing, experts
/// and an optional shared expert (`moe::SparseMlp`).
#[pyclass(name = "MoeBlock", module = "fastllm._core", frozen)]
struct PyMoeBlock {
    block: Arc<SparseMlp>,
}

/// The block of a `MoeBlock` object (shared, for the decoder stack).
pub(super) fn block_of(obj: &Bound<'_, PyAny>) -> PyResult<Arc<SparseMlp>> {
    let block = obj
        .cast::<PyMoeBlock>()
        .map_err(|_| PyValueError::new_err("moe: expected a MoeBlock"))?;
    Ok(block.get().block.clone())
}

fn optional_weight(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<LinearWeight>> {
    match obj {
        Some(o) if !o.is_none() => Ok(Some(linear_weight(o, name)?)),
        _ => Ok(None),
    }
}

#[pymethods]
impl PyMoeBlock {
    /// `router`: a float `PackedLinear` [experts, hidden] (float32 logits);
    /// `experts`: a `MoeExperts`; each token's `top_k` best experts by
    /// `scoring` ("softmax" or "sigmoid"), renormalised when `renormalize`;
    /// the shared expert (none, or `shared_gate_up` [2I, H] and `shared_down`
    /// [H, I] with `shared_gate` [1, H] (float: a sigmoid gate) or None
    /// (added ungated: Granite 4.0's dense MLP)); `selection_bias`,
    /// `renorm_eps` and `scale` as `moe_route`'s.
    #[new]
    #[pyo3(signature = (router, experts, top_k, scoring="softmax", renormalize=true,
                        shared_gate_up=None, shared_down=None, shared_gate=None,
                        selection_bias=None, renorm_eps=0.0, scale=1.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        router: &Bound<'_, PyAny>,
        experts: &Bound<'_, PyAny>,
        top_k: usize,
        scoring: &str,
        renormalize: bool,
        shared_gate_up: Option<&Bound<'_, PyAny>>,
        shared_down: Option<&Bound<'_, PyAny>>,
        shared_gate: Option<&Bound<'_, PyAny>>,
        selection_bias: Option<Vec<f32>>,
        renorm_eps: f32,
        scale: f32,
    ) -> PyResult<Self> {
        let router = linear_weight(router, "router")?;
        let experts = experts_of(experts)?;
        let rule = Rule {
            renorm_eps,
            scale,
            bias: selection_bias,
            ..Rule::new(top_k, parse_scoring(scoring)?, renormalize)
        };
        let parts = (
            optional_weight(shared_gate_up, "shared_gate_up")?,
            optional_weight(shared_down, "shared_down")?,
            optional_weight(shared_gate, "shared_gate")?,
        );
        let shared = match parts {
            (Some(gate_up), Some(down), gate) => Some(SharedExpert {
                gate_up,
                down,
                gate,
            }),
            (None, None, None) => None,
            _ => {
                return Err(PyValueError::new_err(
                    "shared_gate_up, shared_down, shared_gate: give the first two (and the \
                     gate, or None for an ungated shared expert) or none",
                ))
            }
        };
        let block = SparseMlp::new(router, experts, rule, shared)?;
        Ok(PyMoeBlock {
            block: Arc::new(block),
        })
    }

    /// `out` [T, H] = the block on `x` [T, H] (bf16 or f32, one dtype).
    /// Releases the GIL.
    fn forward(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let h = self.block.experts.hidden();
        let x = TensorArg::extract("x", x)?;
        x.check(&[DType::BF16, DType::F32], 2)?;
        x.expect_dim(1, h, "hidden_size")?;
        let tokens = x.shape[0];
        let out = TensorArg::extract("out", out)?;
        out.check(&[x.dtype], 2)?;
        out.expect_dim(0, tokens, "tokens of x")?;
        out.expect_dim(1, h, "hidden_size")?;
        check_no_overlap(&out, &x)?;
        let block = &self.block;
        // SAFETY: both tensors were checked (dtype, CPU, contiguity, shape)
        // and share no memory; the caller keeps them alive.
        unsafe {
            match x.dtype {
                DType::BF16 => {
                    let (o, xs) = (out.slice_mut::<bf16>(), x.slice::<bf16>());
                    py.detach(move || block.forward(o, xs, tokens))?
                }
                _ => {
                    let (o, xs) = (out.slice_mut::<f32>(), x.slice::<f32>());
                    py.detach(move || block.forward(o, xs, tokens))?
                }
            }
        }
        Ok(())
    }

    #[getter]
    fn top_k(&self) -> usize {
        self.block.rule.top_k
    }

    #[getter]
    fn num_experts(&self) -> usize {
        self.block.experts.num_experts()
    }

    fn __repr__(&self) -> String {
        let (b, r) = (&self.block, &self.block.rule);
        let py_bool = |v: bool| if v { "True" } else { "False" };
        format!(
            "MoeBlock(num_experts={}, top_k={}, scoring={}, renormalize={}, shared_expert={}, \
             selection_bias={}, renorm_eps={}, scale={})",
            b.experts.num_experts(),
            r.top_k,
            r.scoring.name(),
            py_bool(r.renormalize),
            py_bool(b.shared.is_some()),
            py_bool(r.bias.is_some()),
            r.renorm_eps,
            r.scale
        )
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMoeBlock>()?;
    m.add_class::<PyMoeExperts>()?;
    m.add_function(wrap_pyfunction!(moe_route, m)?)?;
    Ok(())
}
