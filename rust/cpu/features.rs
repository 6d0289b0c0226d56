//! What this CPU, and the operating system, let the kernels use: the only
//! place in the crate that detects CPU or OS features.
//!
//! SIMD paths are chosen at run time from these flags, never from compile-time
//! target features, so one wheel runs everywhere without an illegal
//! instruction. AMX needs more than CPUID: Linux only hands out the tile
//! state to a process that asked for it with
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`.

use std::sync::OnceLock;

/// The instruction-set features that matter to fastllm's CPU kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    /// AVX2 (with OS support for the YMM state).
    pub avx2: bool,
    /// Fused multiply-add.
    pub fma: bool,
    /// AVX-512 Foundation (with OS support for the ZMM state).
    pub avx512f: bool,
    /// AVX-512 byte and word instructions.
    pub avx512bw: bool,
    /// AVX-512 vector-length extensions (the 128/256-bit forms).
    pub avx512vl: bool,
    /// AVX-512 VNNI: int8 dot products (`vpdpbusd`).
    pub avx512vnni: bool,
    /// AVX-VNNI: the same int8 dot products on 256-bit vectors (VEX encoded).
    pub avxvnni: bool,
    /// F16C: half-precision conversions (the quantized kernels' scales).
    pub f16c: bool,
    /// AVX512-BF16: native bf16 dot products.
    pub avx512bf16: bool,
    /// CPUID reports AMX tiles.
    pub amx_tile: bool,
    /// CPUID reports AMX bf16 matrix multiply.
    pub amx_bf16: bool,
    /// The OS granted this process the AMX tile state (Linux `arch_prctl`).
    pub amx_permitted: bool,
}

impl CpuFeatures {
    /// AVX2 with FMA: what the `Avx2` kernels need.
    pub fn avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }

    /// AVX-512F/BW/VL with AVX2 and FMA: what the `Avx512` kernels need.
    pub fn avx512(&self) -> bool {
        self.avx512f && self.avx512bw && self.avx512vl && self.avx2_fma()
    }

    /// AMX bf16 tiles can actually be executed by this process.
    pub fn amx_usable(&self) -> bool {
        self.amx_tile && self.amx_bf16 && self.amx_permitted
    }

    /// The flags as `(name, value)` pairs, in a fixed order.
    pub fn as_pairs(&self) -> [(&'static str, bool); 13] {
        [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512vl", self.avx512vl),
            ("avx512vnni", self.avx512vnni),
            ("avxvnni", self.avxvnni),
            ("avx512bf16", self.avx512bf16),
            ("amx_tile", self.amx_tile),
            ("amx_bf16", self.amx_bf16),
            ("amx_permitted", self.amx_permitted),
            ("amx", self.amx_usable()),
        ]
    }
}

static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();

/// The features of this CPU, detected once per process.
pub fn features() -> CpuFeatures {
    *FEATURES.get_or_init(detect)
}

/// Whether the CPU is Intel's (CPUID vendor "GenuineIntel"): some memory-bound
/// kernels choose their access pattern by vendor, where the same code streams
/// at very different rates (see `gemm::tile`).
pub fn is_intel() -> bool {
    static INTEL: OnceLock<bool> = OnceLock::new();
    *INTEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid_count;
            // SAFETY: CPUID leaf 0 exists on every x86_64 CPU.
            #[allow(unused_unsafe)]
            let r = unsafe { __cpuid_count(0, 0) };
            let mut vendor = [0u8; 12];
            vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
            vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
            vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
            &vendor == b"GenuineIntel"
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuFeatures {
    use std::arch::x86_64::__cpuid_count;

    // SAFETY (for older toolchains where cpuid is unsafe): CPUID exists on
    // every x86_64 CPU; leaf 7 is only read when the max leaf allows it.
    #[allow(unused_unsafe)]
    let max_leaf = unsafe { __cpuid_count(0, 0) }.eax;
    #[allow(unused_unsafe)]
    let leaf7 = (max_leaf >= 7).then(|| unsafe { __cpuid_count(7, 0) });
    let amx_tile = leaf7.is_some_and(|r| r.edx & (1 << 24) != 0);
    let amx_bf16 = leaf7.is_some_and(|r| r.edx & (1 << 22) != 0);
    CpuFeatures {
        avx2: std::is_x86_feature_detected!("avx2"),
        fma: std::is_x86_feature_detected!("fma"),
        avx512f: std::is_x86_feature_detected!("avx512f"),
        avx512bw: std::is_x86_feature_detected!("avx512bw"),
        avx512vl: std::is_x86_feature_detected!("avx512vl"),
        avx512vnni: std::is_x86_feature_detected!("avx512vnni"),
        avxvnni: std::is_x86_feature_detected!("avxvnni"),
        f16c: std::is_x86_feature_detected!("f16c"),
        avx512bf16: std::is_x86_feature_detected!("avx512bf16"),
        amx_tile,
        amx_bf16,
        amx_permitted: amx_tile && request_amx_permission(),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures::default()
}

/// Asks Linux for the AMX tile data state; true when it is granted.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx_permission() -> bool {
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these codes only reads or sets a per-process
    // permission bit; a kernel without AMX support returns an error.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if rc != 0 {
        return false;
    }
    let mut mask: u64 = 0;
    // SAFETY: the kernel writes one u64 bitmask of permitted features.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut mask as *mut u64,
        )
    };
    rc == 0 && mask & (1 << XFEATURE_XTILEDATA) != 0
}

/// Other systems do not expose AMX tiles to fastllm.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_amx_permission() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_consistent() {
        let f = features();
        assert_eq!(f, features());
        // Every CPU with AVX-512 BF16 has AVX-512F; AMX use needs all three bits.
        assert!(!f.avx512bf16 || f.avx512f);
        assert_eq!(f.amx_usable(), f.amx_tile && f.amx_bf16 && f.amx_permitted);
        assert!(!f.amx_permitted || f.amx_tile);
        let names: Vec<_> = f.as_pairs().iter().map(|(n, _)| *n).collect();
        assert_eq!(names.len(), 13);
        assert!(names.contains(&"avx512bf16"));
    }

    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn matches_proc_cpuinfo() {
        // An independent reference: the kernel's own view of the CPU flags.
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(flags) = info.lines().find(|l| l.starts_with("flags")) else {
            return;
        };
        let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
        let f = features();
        assert_eq!(f.avx2, has("avx2"));
        assert_eq!(f.fma, has("fma"));
        assert_eq!(f.avx512f, has("avx512f"));
        assert_eq!(f.avx512bw, has("avx512bw"));
        assert_eq!(f.avx512vl, has("avx512vl"));
        assert_eq!(f.avx512vnni, has("avx512_vnni"));
        assert_eq!(f.avxvnni, has("avx_vnni"));
        assert_eq!(f.f16c, has("f16c"));
        assert_eq!(f.avx512bf16, has("avx512_bf16"));
        assert_eq!(f.amx_tile, has("amx_tile"));
        assert_eq!(f.amx_bf16, has("amx_bf16"));
    }
}
