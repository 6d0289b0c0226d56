//! Mixture-of-experts layers on the CPU: the router ([`route`]: softmax or
//! sigmoid scores, top-k with an optional selection bias, optional
//! renormalisation and scale, [`Rule`]) and the grouped expert
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
pub use route::{route, Rule, Scoring};

use std::sync::Arc;

use crate::cpu::Element;
use crate::error::{CoreError, CoreResult};
use crate::layers::gated_act;
use crate::linear::LinearWeight;

/// A whole sparse MLP block: the router (a float linear [experts, hidden]
/// with float32 logits), the routing rule, the experts and (Qwen2-MoE) a
/// shared expert. The Python layer (`_core.MoeBlock`) and the fused decoder
/// stack run it in place of a dense MLP.
#[derive(Debug)]
pub struct SparseMlp {
    pub router: LinearWeight,
    pub experts: Arc<Experts>,
    pub rule: Rule,
    pub shared: Option<SharedExpert>,
}

/// A dense expert every token runs through, scaled by `sigmoid(x w_gate)`
/// (Qwen2-MoE; without `gate`, Granite 4.0's dense MLP beside its experts,
/// unscaled) and added: `gate_up` [2I, H], `down` [H, I] (the experts'
/// activation), `gate` [1, H] (float, float32 logits).
#[derive(Debug)]
pub struct SharedExpert {
    pub gate_up: LinearWeight,
    pub down: LinearWeight,
    pub gate: Option<LinearWeight>,
}

impl SparseMlp {
    /// Checks the router's shape and the routing rule against the experts.
    pub fn new(
        router: LinearWeight,
        experts: Arc<Experts>,
        rule: Rule,
        shared: Option<SharedExpert>,
    ) -> CoreResult<SparseMlp> {
        let (e, h) = (experts.num_experts(), experts.hidden());
        if let Some(sh) = &shared {
            let i = sh.down.in_features();
            let mut shapes = vec![
                ("shared_gate_up", &sh.gate_up, 2 * i, h),
                ("shared_down", &sh.down, h, i),
            ];
            if let Some(gate) = &sh.gate {
                shapes.push(("shared_gate", gate, 1, h));
            }
            for (name, w, n, k) in shapes {
                if w.out_features() != n || w.in_features() != k {
                    return Err(CoreError::invalid(format!(
                        "{name}: expected a [{n}, {k}] weight, got [{}, {}]",
                        w.out_features(),
                        w.in_features()
                    )));
                }
            }
        }
        if router.out_features() != e || router.in_features() != h {
            return Err(CoreError::invalid(format!(
                "router: expected a [{e}, {h}] weight (experts, hidden), got [{}, {}]",
                router.out_features(),
                router.in_features()
            )));
        }
        rule.check(e)?;
        Ok(SparseMlp {
            router,
            experts,
            rule,
            shared,
        })
    }

    /// `out [tokens, hidden]` = the block on `x [tokens, hidden]`.
    pub fn forward<T: Element>(&self, out: &mut [T], x: &[T], tokens: usize) -> CoreResult<()> {
        let (e, k) = (self.experts.num_experts(), self.rule.top_k);
        let mut logits = vec![0f32; tokens * e];
        self.router
            .forward(f32::dst(&mut logits), T::src(x), tokens)?;
        let mut ids = vec![0i32; tokens * k];
        let mut weights = vec![0f32; tokens * k];
        route(&logits, tokens, e, &self.rule, &mut ids, &mut weights)?;
        self.experts.forward(out, x, &ids, &weights, tokens, k)?;
        match &self.shared {
            Some(sh) => self.add_shared(sh, out, x, tokens),
            None => Ok(()),
        }
    }

    /// `out += sigmoid(x w_gate) * shared(x)` (without a gate `out +=
    /// shared(x)`), each product and sum rounded to the element type as
    /// torch does in the model's dtype.
    fn add_shared<T: Element>(
        &self,
        sh: &SharedExpert,
        out: &mut [T],
        x: &[T],
        tokens: usize,
    ) -> CoreResult<()> {
        let (h, i) = (self.experts.hidden(), sh.down.in_features());
        let zero = T::from_f32(0.0);
        let mut gate_up = vec![zero; tokens * 2 * i];
        sh.gate_up
            .forward(T::dst(&mut gate_up), T::src(x), tokens)?;
        let mut act = vec![zero; tokens * i];
        gated_act(T::dst(&mut act), T::src(&gate_up), i, self.experts.act)?;
        let mut y = vec![zero; tokens * h];
        sh.down.forward(T::dst(&mut y), T::src(&act), tokens)?;
        let Some(gate) = &sh.gate else {
            for (a, &b) in out.iter_mut().zip(&y) {
                *a = T::from_f32(a.to_f32() + b.to_f32());
            }
            return Ok(());
        };
        let mut g = vec![0f32; tokens];
        gate.forward(f32::dst(&mut g), T::src(x), tokens)?;
        for ((o, yr), &gt) in out.chunks_exact_mut(h).zip(y.chunks_exact(h)).zip(&g) {
            let gate = T::from_f32(1.0 / (1.0 + (-gt).exp())).to_f32();
            for (a, &b) in o.iter_mut().zip(yr) {
                let p = T::from_f32(gate * b.to_f32()).to_f32();
                *a = T::from_f32(a.to_f32() + p);
            }
        }
        Ok(())
    }
}
