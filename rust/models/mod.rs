//! Whole-model code in Rust, one file per model family, beside the family's
//! Python model (`python/fastllm/models/`): `llama.rs`, the fused decoder
//! stack of the Llama family.

pub mod llama;
