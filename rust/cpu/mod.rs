//! The CPU side of the core, below the kernels: what this CPU and OS allow
//! (`features`), the kernel paths that follows from it (`Path`), the one
//! element trait for f32/bf16 data (`elem`), the SIMD vocabulary every kernel
//! is written in once (`simd`), and the threads the kernels run on
//! (`threads`).
//!
//! Every kernel asks `features()` (through `Path`) what it may run; nothing
//! else in the crate detects a CPU or OS feature.

pub mod bandwidth;
pub mod elem;
pub mod features;
pub mod simd;
pub mod threads;

pub use elem::{Dst, Element, Src};
pub use features::{features, CpuFeatures};

/// One instruction-set path of the CPU kernels, from the most portable to
/// the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// Plain Rust, f32 accumulation; runs everywhere.
    Scalar,
    /// AVX2 + FMA, 8 f32 lanes.
    Avx2,
    /// AVX-512F/BW/VL (with AVX2 and FMA), 16 f32 lanes.
    Avx512,
    /// AVX512-BF16 CPUs: the AVX-512 code, except that the GEMM runs bf16
    /// weights against bf16 rows with `vdpbf16ps` (`gemm::dot_bf16`; see
    /// `gemm::default_path` for the CPUs it is chosen on).
    Avx512Bf16,
}

impl Path {
    /// Every path, in order of the instruction sets they need.
    pub const ALL: [Path; 4] = [Path::Scalar, Path::Avx2, Path::Avx512, Path::Avx512Bf16];

    /// The name used by the `path` arguments and the Python bindings.
    pub fn name(self) -> &'static str {
        match self {
            Path::Scalar => "scalar",
            Path::Avx2 => "avx2",
            Path::Avx512 => "avx512",
            Path::Avx512Bf16 => "avx512bf16",
        }
    }

    /// Parses a path name (case-insensitive).
    pub fn parse(name: &str) -> Option<Path> {
        let name = name.trim().to_ascii_lowercase();
        Path::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this CPU (and OS) can run the path.
    pub fn is_available(self) -> bool {
        let f = features();
        match self {
            Path::Scalar => true,
            Path::Avx2 => f.avx2_fma(),
            Path::Avx512 => f.avx512(),
            Path::Avx512Bf16 => f.avx512() && f.avx512bf16,
        }
    }

    /// The SIMD code this path runs (`Avx512Bf16` runs the AVX-512 code).
    pub fn simd(self) -> Path {
        match self {
            Path::Avx512Bf16 => Path::Avx512,
            p => p,
        }
    }
}

/// The paths this CPU can run, in the order of `Path::ALL`.
pub fn available_paths() -> Vec<Path> {
    Path::ALL.into_iter().filter(|p| p.is_available()).collect()
}

/// The fastest SIMD code this CPU can run: `Avx512`, `Avx2` or `Scalar`.
pub fn fastest_path() -> Path {
    [Path::Avx512, Path::Avx2]
        .into_iter()
        .find(|p| p.is_available())
        .unwrap_or(Path::Scalar)
}

/// The switch naming the SIMD code of the kernels other than the GEMMs
/// (attention, sampling, norms, activations, the recurrent kernels), to
/// compare paths on one CPU.
pub const SIMD_PATH_ENV: &str = "FASTLLM_CPU_SIMD_PATH";

/// The path `SIMD_PATH_ENV` names (the fastest when it is unset or empty),
/// or an error naming the switch when it names no path this CPU runs.
pub fn simd_path_from_env() -> Result<Path, String> {
    let value = std::env::var(SIMD_PATH_ENV).unwrap_or_default();
    let name = value.trim();
    if name.is_empty() {
        return Ok(fastest_path());
    }
    let names: Vec<&str> = [Path::Scalar, Path::Avx2, Path::Avx512]
        .iter()
        .map(|p| p.name())
        .collect();
    let path = Path::parse(name)
        .filter(|p| p.simd() == *p)
        .ok_or_else(|| {
            format!("{SIMD_PATH_ENV}={name:?}: unknown path, expected one of {names:?}")
        })?;
    if !path.is_available() {
        return Err(format!(
            "{SIMD_PATH_ENV}={name:?}: this CPU cannot run that path (it runs up to {:?})",
            fastest_path().name()
        ));
    }
    Ok(path)
}

/// The SIMD code of the kernels other than the GEMMs: the fastest this CPU
/// runs, or the one `FASTLLM_CPU_SIMD_PATH` names (read once per process;
/// a bad value falls back to the fastest here, and the Python side refuses
/// it with `simd_path_from_env`'s error).
pub fn best_path() -> Path {
    static PATH: std::sync::OnceLock<Path> = std::sync::OnceLock::new();
    *PATH.get_or_init(|| simd_path_from_env().unwrap_or_else(|_| fastest_path()))
}

/// Parses a path name and checks this CPU can run it.
pub fn check_path(name: &str) -> Result<Path, String> {
    let names: Vec<&str> = Path::ALL.iter().map(|p| p.name()).collect();
    let path = Path::parse(name)
        .ok_or_else(|| format!("unknown linear kernel path '{name}', expected one of {names:?}"))?;
    if !path.is_available() {
        let avail: Vec<&str> = available_paths().iter().map(|p| p.name()).collect();
        return Err(format!(
            "linear kernel path '{name}' is not supported by this CPU (available: {avail:?})"
        ));
    }
    Ok(path)
}

/// The switch naming the integer kernels' path (quantized weights), to
/// compare paths on one CPU.
pub const INT_PATH_ENV: &str = "FASTLLM_CPU_INT_PATH";

/// The path `INT_PATH_ENV` names (the fastest when it is unset or empty),
/// or an error naming the switch when it names no path this CPU runs.
pub fn int_path_from_env() -> Result<IntPath, String> {
    let value = std::env::var(INT_PATH_ENV).unwrap_or_default();
    let name = value.trim();
    if name.is_empty() {
        return Ok(IntPath::best());
    }
    IntPath::check(name).map_err(|e| format!("{INT_PATH_ENV}={name:?}: {e}"))
}

/// One instruction-set path of the integer (quantized-weight) kernels: how
/// int8 dot products are computed, from the most portable to the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntPath {
    /// Plain Rust; runs everywhere.
    Scalar,
    /// AVX2 (with FMA and F16C): `vpmaddubsw` + `vpmaddwd` on 256 bits.
    Avx2,
    /// AVX-VNNI: `vpdpbusd` on 256 bits.
    AvxVnni,
    /// AVX-512BW: `vpmaddubsw` + `vpmaddwd` on 512 bits.
    Avx512,
    /// AVX512-VNNI: `vpdpbusd` on 512 bits.
    Avx512Vnni,
}

impl IntPath {
    /// Every path, in order of the instruction sets they need.
    pub const ALL: [IntPath; 5] = [
        IntPath::Scalar,
        IntPath::Avx2,
        IntPath::AvxVnni,
        IntPath::Avx512,
        IntPath::Avx512Vnni,
    ];

    /// The name used by the `path` arguments and the Python bindings.
    pub fn name(self) -> &'static str {
        match self {
            IntPath::Scalar => "scalar",
            IntPath::Avx2 => "avx2",
            IntPath::AvxVnni => "avxvnni",
            IntPath::Avx512 => "avx512",
            IntPath::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU (and OS) can run the path.
    pub fn is_available(self) -> bool {
        let f = features();
        let avx2 = f.avx2_fma() && f.f16c;
        match self {
            IntPath::Scalar => true,
            IntPath::Avx2 => avx2,
            IntPath::AvxVnni => avx2 && f.avxvnni,
            IntPath::Avx512 => avx2 && f.avx512(),
            IntPath::Avx512Vnni => avx2 && f.avx512() && f.avx512vnni,
        }
    }

    /// The paths this CPU can run, in the order of `ALL`.
    pub fn available() -> Vec<IntPath> {
        IntPath::ALL
            .into_iter()
            .filter(|p| p.is_available())
            .collect()
    }

    /// The fastest path this CPU can run: VNNI before the two-instruction
    /// dot products, 512 bits before 256.
    pub fn best() -> IntPath {
        [
            IntPath::Avx512Vnni,
            IntPath::AvxVnni,
            IntPath::Avx512,
            IntPath::Avx2,
        ]
        .into_iter()
        .find(|p| p.is_available())
        .unwrap_or(IntPath::Scalar)
    }

    /// Parses a path name and checks this CPU can run it.
    pub fn check(name: &str) -> Result<IntPath, String> {
        let names: Vec<&str> = IntPath::ALL.iter().map(|p| p.name()).collect();
        let wanted = name.trim().to_ascii_lowercase();
        let path = IntPath::ALL
            .into_iter()
            .find(|p| p.name() == wanted)
            .ok_or_else(|| {
                format!("unknown quantized kernel path '{name}', expected one of {names:?}")
            })?;
        if !path.is_available() {
            let avail: Vec<&str> = IntPath::available().iter().map(|p| p.name()).collect();
            return Err(format!(
                "quantized kernel path '{name}' is not supported by this CPU (available: {avail:?})"
            ));
        }
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_names_round_trip_and_unknown_is_rejected() {
        for p in Path::ALL {
            assert_eq!(Path::parse(p.name()), Some(p));
        }
        assert_eq!(Path::parse(" AVX2 "), Some(Path::Avx2));
        assert!(check_path("sse9").unwrap_err().contains("unknown"));
        assert_eq!(check_path("scalar"), Ok(Path::Scalar));
        assert!(available_paths().contains(&best_path()));
        assert!(IntPath::available().contains(&IntPath::best()));
        assert!(IntPath::check("vnni").unwrap_err().contains("unknown"));
        assert_eq!(IntPath::check(" Scalar"), Ok(IntPath::Scalar));
    }
}
