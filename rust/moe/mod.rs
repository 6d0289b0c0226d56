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
