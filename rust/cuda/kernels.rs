//! The CUDA sources of `kernels/`, embedded in the library so a wheel carries
//! them; compiled by NVRTC for the GPU found at run time.

/// Include name and contents of the header every kernel file includes.
pub const COMMON_HEADER: (&str, &str) = ("common.cuh", include_str!("../../kernels/common.cuh"));

/// `(file name, source)` of every kernel file.
pub const SOURCES: &[(&str, &str)] = &[
    ("attention.cu", include_str!("../../kernels/attention.cu")),
    ("cache.cu", include_str!("../../kernels/cache.cu")),
    ("sampler.cu", include_str!("../../kernels/sampler.cu")),
    ("layers.cu", include_str!("../../kernels/layers.cu")),
];

/// The source of kernel file `name`, or an error listing the files.
pub fn source(name: &str) -> crate::CoreResult<&'static str> {
    SOURCES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .ok_or_else(|| {
            let names: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
            crate::CoreError::invalid(format!(
                "no kernel file {name:?}; kernel files: {}",
                names.join(", ")
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_is_embedded_and_includes_the_header() {
        for (name, src) in SOURCES {
            assert!(src.contains("#include \"common.cuh\""), "{name}");
            assert!(src.contains("extern \"C\" __global__"), "{name}");
        }
        assert!(source("attention.cu").is_ok());
        assert!(source("nope.cu")
            .unwrap_err()
            .to_string()
            .contains("sampler.cu"));
    }
}
