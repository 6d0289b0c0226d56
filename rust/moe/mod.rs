//! Mixture-of-experts layers on the CPU: the router ([`route`]: softmax or
//! sigmoid scores, top-k, optional renormalisation) and the grouped expert
//! FFN ([`Experts`]: every expert a gate/up and a down [`LinearWeight`],
//! float or quantized).
//!
//! [`Experts::forward`] groups the tokens by expert (a counting sort of the
//! routing ids) and runs only the experts that received rows: gather their
//! rows of `x`, gate/up projection, gated activation (`layers::gated_act`),
//! down projection, `weight * row` added into an f32 accumulator that is
//! rounded to the element type once at the end. An expert without a token is
//! never read, so a batch-1 decode step streams only its `top_k` experts'
//! weights. The GEMMs split their output over the thread team themselves,
//! so the experts run one after the other.
//!
//! [`LinearWeight`]: crate::linear::LinearWeight

mod experts;
mod route;

pub use experts::{ExpertAct, Experts};
pub use route::{route, Scoring};

use std::sync::Arc;

use crate::cpu::Element;
use crate::error::{CoreError, CoreResult};
use crate::linear::LinearWeight;

/// A whole sparse MLP block: the router (a float linear [experts, hidden]
/// with float32 logits), the routing rule and the experts. The fused
/// decoder stack runs it in place of a dense MLP.
#[derive(Debug)]
pub struct SparseMlp {
    pub router: LinearWeight,
    pub experts: Arc<Experts>,
    pub top_k: usize,
    pub scoring: Scoring,
    pub renormalize: bool,
}

impl SparseMlp {
    /// Checks the router's shape against the experts and `top_k`.
    pub fn new(
        router: LinearWeight,
        experts: Arc<Experts>,
        top_k: usize,
        scoring: Scoring,
        renormalize: bool,
    ) -> CoreResult<SparseMlp> {
        let (e, h) = (experts.num_experts(), experts.hidden());
        if router.out_features() != e || router.in_features() != h {
            return Err(CoreError::invalid(format!(
                "router: expected a [{e}, {h}] weight (experts, hidden), got [{}, {}]",
                router.out_features(),
                router.in_features()
            )));
        }
        if top_k == 0 || top_k > e {
            return Err(CoreError::invalid(format!(
                "top_k: must be between 1 and the {e} experts, got {top_k}"
            )));
        }
        Ok(SparseMlp {
            router,
            experts,
            top_k,
            scoring,
            renormalize,
        })
    }

    /// `out [tokens, hidden]` = the block on `x [tokens, hidden]`.
    pub fn forward<T: Element>(&self, out: &mut [T], x: &[T], tokens: usize) -> CoreResult<()> {
        let (e, k) = (self.experts.num_experts(), self.top_k);
        let mut logits = vec![0f32; tokens * e];
        self.router
            .forward(f32::dst(&mut logits), T::src(x), tokens)?;
        let mut ids = vec![0i32; tokens * k];
        let mut weights = vec![0f32; tokens * k];
        let (scoring, renorm) = (self.scoring, self.renormalize);
        route(
            &logits,
            tokens,
            e,
            k,
            scoring,
            renorm,
            &mut ids,
            &mut weights,
        )?;
        self.experts.forward(out, x, &ids, &weights, tokens, k)
    }
}
