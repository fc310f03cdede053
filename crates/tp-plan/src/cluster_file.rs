//! The small TOML cluster description (`--cluster FILE`): an accelerator preset
//! or custom accelerator, device counts and optional bandwidth overrides.

use crate::hardware::{accelerator_preset, AcceleratorKind, AcceleratorSpec, ClusterSpec};
use crate::PlanError;
use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    accelerator: Option<String>,
    custom_accelerator: Option<CustomAccelerator>,
    gpus: u64,
    gpus_per_node: u64,
    intra_node_bandwidth_gbs: Option<f64>,
    inter_node_bandwidth_gbs: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CustomAccelerator {
    name: String,
    peak_tflops: f64,
    memory_gib: f64,
    memory_bandwidth_gbs: f64,
    gemm_efficiency: Option<f64>,
    /// Set for a CPU machine: tensor-parallel ranks become threads on these cores.
    cpu_cores: Option<u64>,
    /// CPU machines only: read bandwidth one core draws alone. Default
    /// `memory_bandwidth_gbs / cpu_cores`, each core's share of the machine.
    memory_bandwidth_per_core_gbs: Option<f64>,
}

/// Parses cluster TOML text; `path` is only used in error messages.
pub fn parse_cluster_toml(text: &str, path: &Path) -> Result<ClusterSpec, PlanError> {
    let malformed = |message: String| PlanError::MalformedClusterFile {
        path: path.to_path_buf(),
        message,
    };
    let file: ClusterFile = toml::from_str(text).map_err(|e| malformed(e.to_string()))?;
    let accelerator = match (&file.accelerator, &file.custom_accelerator) {
        (Some(name), None) => accelerator_preset(name)?,
        (None, Some(custom)) => custom_spec(custom).map_err(malformed)?,
        _ => {
            return Err(malformed(
                "give exactly one of `accelerator = \"<preset>\"` or `[custom_accelerator]`"
                    .to_string(),
            ))
        }
    };
    let mut cluster = ClusterSpec::new(accelerator, file.gpus, file.gpus_per_node)?;
    if let Some(bw) = file.intra_node_bandwidth_gbs {
        cluster.intra_node_bandwidth = bw * 1e9;
    }
    if let Some(bw) = file.inter_node_bandwidth_gbs {
        cluster.inter_node_bandwidth = bw * 1e9;
    }
    cluster.validate()?;
    Ok(cluster)
}

/// The accelerator of a `[custom_accelerator]` table. A CPU machine's per-core
/// bandwidth defaults to the machine's divided by its cores: a lower bound on
/// what one core draws alone (the machine figure is reached with every core
/// streaming), exact at tp = cores, and what the 2-core preset measured.
fn custom_spec(custom: &CustomAccelerator) -> Result<AcceleratorSpec, String> {
    let machine_bandwidth = custom.memory_bandwidth_gbs * 1e9;
    let (kind, per_core) = match (custom.cpu_cores, custom.memory_bandwidth_per_core_gbs) {
        (Some(cores), per_core_gbs) => {
            let cores = cores.max(1);
            let per_core = per_core_gbs.map_or(machine_bandwidth / cores as f64, |gbs| gbs * 1e9);
            (AcceleratorKind::CpuMachine { cores }, Some(per_core))
        }
        (None, None) => (AcceleratorKind::Gpu, None),
        (None, Some(_)) => {
            return Err(
                "`memory_bandwidth_per_core_gbs` needs `cpu_cores` (it describes a CPU machine)"
                    .to_string(),
            )
        }
    };
    Ok(AcceleratorSpec {
        name: custom.name.clone(),
        kind,
        peak_flops: custom.peak_tflops * 1e12,
        memory_bytes: custom.memory_gib * 1024.0 * 1024.0 * 1024.0,
        memory_bandwidth: machine_bandwidth,
        memory_bandwidth_per_core: per_core,
        gemm_efficiency: custom.gemm_efficiency.unwrap_or(0.7),
        default_intra_node_bandwidth: 300e9,
        default_inter_node_bandwidth: 25e9,
    })
}

/// Reads and parses a cluster TOML file.
pub fn load_cluster_file(path: &Path) -> Result<ClusterSpec, PlanError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlanError::FileRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_cluster_toml(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_with_overrides() {
        let c = parse_cluster_toml(
            "accelerator = \"h100\"\ngpus = 16\ngpus_per_node = 8\ninter_node_bandwidth_gbs = 100\n",
            Path::new("c.toml"),
        )
        .unwrap();
        assert_eq!(c.num_devices, 16);
        assert_eq!(c.inter_node_bandwidth, 100e9);
    }

    #[test]
    fn custom_accelerator() {
        let text = "gpus = 8\ngpus_per_node = 8\n[custom_accelerator]\nname = \"x\"\npeak_tflops = 100\nmemory_gib = 16\nmemory_bandwidth_gbs = 1000\n";
        let c = parse_cluster_toml(text, Path::new("c.toml")).unwrap();
        assert_eq!(c.accelerator.peak_flops, 100e12);
    }

    #[test]
    fn custom_cpu_machine_per_core_bandwidth() {
        let cpu = "gpus = 1\ngpus_per_node = 1\n[custom_accelerator]\nname = \"box\"\npeak_tflops = 1\nmemory_gib = 64\nmemory_bandwidth_gbs = 80\ncpu_cores = 8\n";
        // Default: each core's share of the machine, 80 / 8 GB/s.
        let c = parse_cluster_toml(cpu, Path::new("c.toml")).unwrap();
        assert_eq!(c.accelerator.memory_bandwidth_per_core, Some(10e9));
        assert_eq!(c.accelerator.rank_memory_bandwidth(2), 10e9);
        // Given: one core draws 20 GB/s, so 4 threads saturate the machine.
        let text = format!("{cpu}memory_bandwidth_per_core_gbs = 20\n");
        let c = parse_cluster_toml(&text, Path::new("c.toml")).unwrap();
        assert_eq!(c.accelerator.rank_memory_bandwidth(1), 20e9);
        assert_eq!(c.accelerator.rank_memory_bandwidth(8), 10e9);
        // More than the machine, or on a GPU, is an error.
        let text = format!("{cpu}memory_bandwidth_per_core_gbs = 100\n");
        let e = parse_cluster_toml(&text, Path::new("c.toml")).unwrap_err();
        assert!(matches!(e, PlanError::InvalidCluster(_)), "{e}");
        let gpu = "gpus = 8\ngpus_per_node = 8\n[custom_accelerator]\nname = \"x\"\npeak_tflops = 100\nmemory_gib = 16\nmemory_bandwidth_gbs = 1000\nmemory_bandwidth_per_core_gbs = 10\n";
        let e = parse_cluster_toml(gpu, Path::new("bad.toml")).unwrap_err();
        assert!(
            matches!(e, PlanError::MalformedClusterFile { .. })
                && e.to_string().contains("cpu_cores"),
            "{e}"
        );
    }

    #[test]
    fn malformed_files_are_clear_errors() {
        let p = Path::new("bad.toml");
        for text in [
            "gpus = ",
            "gpus = 8\n",
            "accelerator = \"h100\"\ngpus = 8\ngpus_per_node = 8\nbogus = 1\n",
            "gpus = 8\ngpus_per_node = 8\n",
            "gpus = 1\ngpus_per_node = 1\n[custom_accelerator]\nname = \"x\"\npeak_tflops = 1\nmemory_gib = 1\nmemory_bandwidth_gbs = 10\ncpu_cores = 2\nmemory_bandwidth_per_cpu_gbs = 5\n",
        ] {
            let e = parse_cluster_toml(text, p).unwrap_err();
            assert!(
                matches!(e, PlanError::MalformedClusterFile { .. }),
                "{text}: {e}"
            );
            assert!(e.to_string().contains("bad.toml"));
        }
        let e = parse_cluster_toml("accelerator = \"h100\"\ngpus = 0\ngpus_per_node = 8\n", p);
        assert!(matches!(e, Err(PlanError::ZeroGpus)));
    }
}
