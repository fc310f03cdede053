//! Accelerator presets (peak dense bf16 FLOP/s, memory, bandwidths) and the
//! cluster shape (devices, devices per node, interconnect) with its validation.

use crate::PlanError;
use serde::Serialize;

/// GPUs are one tensor-parallel rank per device; a CPU machine runs its
/// tensor-parallel ranks as threads that share its cores, memory and bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AcceleratorKind {
    Gpu,
    CpuMachine { cores: u64 },
}

/// One accelerator (or one CPU machine).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AcceleratorSpec {
    pub name: String,
    pub kind: AcceleratorKind,
    /// Peak dense bf16 FLOP/s (f32 GEMM FLOP/s for CPU machines).
    pub peak_flops: f64,
    pub memory_bytes: f64,
    /// Main-memory (HBM/DRAM) read bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Fraction of peak a large GEMM reaches (calibrated, see docs/planner.md).
    pub gemm_efficiency: f64,
    /// Default intra-node (NVLink / shared memory) bandwidth per device, bytes/s.
    pub default_intra_node_bandwidth: f64,
    /// Default inter-node (NIC) bandwidth per device, bytes/s.
    pub default_inter_node_bandwidth: f64,
}

const GB: f64 = 1e9;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const TFLOPS: f64 = 1e12;

#[allow(clippy::too_many_arguments)]
fn gpu(
    name: &str,
    tflops: f64,
    mem_gib: f64,
    hbm_gbs: f64,
    intra_gbs: f64,
    inter_gbs: f64,
) -> AcceleratorSpec {
    AcceleratorSpec {
        name: name.to_string(),
        kind: AcceleratorKind::Gpu,
        peak_flops: tflops * TFLOPS,
        memory_bytes: mem_gib * GIB,
        memory_bandwidth: hbm_gbs * GB,
        gemm_efficiency: 0.70,
        default_intra_node_bandwidth: intra_gbs * GB,
        default_inter_node_bandwidth: inter_gbs * GB,
    }
}

fn accelerator_presets() -> Vec<AcceleratorSpec> {
    vec![
        // V100 has no bf16: 125 TFLOP/s is its fp16 tensor-core peak. NVLink2 (DGX-1)
        // 150 GB/s per direction, 100 Gb/s EDR per GPU.
        gpu("v100", 125.0, 32.0, 900.0, 150.0, 12.5),
        // A100: NVLink3 300 GB/s per direction, 200 Gb/s HDR per GPU (DGX A100 / Selene).
        gpu("a100-40", 312.0, 40.0, 1555.0, 300.0, 25.0),
        gpu("a100-80", 312.0, 80.0, 2039.0, 300.0, 25.0),
        // H100/H200 SXM: NVLink4 450 GB/s per direction, 400 Gb/s NDR per GPU.
        gpu("h100", 989.0, 80.0, 3350.0, 450.0, 50.0),
        gpu("h200", 989.0, 141.0e9 / GIB, 4800.0, 450.0, 50.0),
        // MI300X: 7 Infinity Fabric links x 64 GB/s, 400 Gb/s NIC.
        gpu("mi300x", 1307.0, 192.0, 5300.0, 448.0, 50.0),
        // The 2-core development box: measured ~160 GFLOP/s f32 GEMM, 24 GiB,
        // ~25 GB/s read bandwidth, 10 GbE between machines.
        AcceleratorSpec {
            name: "cpu-2core".to_string(),
            kind: AcceleratorKind::CpuMachine { cores: 2 },
            peak_flops: 160e9,
            memory_bytes: 24.0 * GIB,
            memory_bandwidth: 25.0 * GB,
            gemm_efficiency: 1.0,
            default_intra_node_bandwidth: 25.0 * GB,
            default_inter_node_bandwidth: 1.25 * GB,
        },
    ]
}

pub fn accelerator_preset_names() -> String {
    accelerator_presets()
        .iter()
        .map(|a| a.name.clone())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Looks an accelerator preset up by name (case-insensitive).
pub fn accelerator_preset(name: &str) -> Result<AcceleratorSpec, PlanError> {
    let wanted = name.to_ascii_lowercase();
    accelerator_presets()
        .into_iter()
        .find(|a| a.name == wanted)
        .ok_or_else(|| PlanError::UnknownAcceleratorPreset {
            name: name.to_string(),
            valid: accelerator_preset_names(),
        })
}

/// Largest cluster the planner enumerates.
pub const MAX_DEVICES: u64 = 1 << 20;

/// A homogeneous cluster.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterSpec {
    pub accelerator: AcceleratorSpec,
    /// Devices in total (machines, for a CPU preset).
    pub num_devices: u64,
    pub devices_per_node: u64,
    pub intra_node_bandwidth: f64,
    pub inter_node_bandwidth: f64,
    /// Per-message latency α of the α-β model, seconds.
    pub intra_node_latency_s: f64,
    pub inter_node_latency_s: f64,
    /// Fraction of device memory the planner may fill (allocator, context, workspace).
    pub usable_memory_fraction: f64,
}

impl ClusterSpec {
    /// Builds a cluster with the accelerator's default interconnect and checks its shape.
    pub fn new(
        accelerator: AcceleratorSpec,
        num_devices: u64,
        devices_per_node: u64,
    ) -> Result<Self, PlanError> {
        let (intra_latency, inter_latency) = match accelerator.kind {
            AcceleratorKind::Gpu => (5e-6, 10e-6),
            AcceleratorKind::CpuMachine { .. } => (1e-6, 30e-6),
        };
        let cluster = ClusterSpec {
            intra_node_bandwidth: accelerator.default_intra_node_bandwidth,
            inter_node_bandwidth: accelerator.default_inter_node_bandwidth,
            accelerator,
            num_devices,
            devices_per_node,
            intra_node_latency_s: intra_latency,
            inter_node_latency_s: inter_latency,
            usable_memory_fraction: 0.9,
        };
        cluster.validate()?;
        Ok(cluster)
    }

    pub fn validate(&self) -> Result<(), PlanError> {
        if self.num_devices == 0 {
            return Err(PlanError::ZeroGpus);
        }
        if self.devices_per_node == 0 {
            return Err(PlanError::ZeroGpusPerNode);
        }
        if self.num_devices > MAX_DEVICES {
            return Err(PlanError::InvalidCluster(format!(
                "at most {MAX_DEVICES} devices are supported"
            )));
        }
        if !self.num_devices.is_multiple_of(self.devices_per_node)
            && self.num_devices > self.devices_per_node
        {
            return Err(PlanError::GpusNotDivisibleByNode {
                gpus: self.num_devices,
                per_node: self.devices_per_node,
            });
        }
        let positive = [
            self.intra_node_bandwidth,
            self.inter_node_bandwidth,
            self.accelerator.peak_flops,
            self.accelerator.memory_bytes,
            self.accelerator.memory_bandwidth,
            self.accelerator.gemm_efficiency,
            self.usable_memory_fraction,
        ];
        if positive.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            return Err(PlanError::InvalidCluster(
                "bandwidths, FLOP/s, memory and efficiencies must be positive".to_string(),
            ));
        }
        Ok(())
    }

    pub fn usable_memory_bytes(&self) -> f64 {
        self.accelerator.memory_bytes * self.usable_memory_fraction
    }

    /// Bandwidth and latency for a collective whose group of `group_span`
    /// consecutive ranks does (not) stay inside one node.
    pub fn link_for_span(&self, group_span: u64) -> (f64, f64) {
        if self.is_cpu() || group_span <= self.devices_per_node {
            (self.intra_node_bandwidth, self.intra_node_latency_s)
        } else {
            (self.inter_node_bandwidth, self.inter_node_latency_s)
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self.accelerator.kind, AcceleratorKind::CpuMachine { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_gpus_and_bad_node_split_are_errors() {
        let a = accelerator_preset("a100-80").unwrap();
        assert!(matches!(
            ClusterSpec::new(a.clone(), 0, 8),
            Err(PlanError::ZeroGpus)
        ));
        assert!(matches!(
            ClusterSpec::new(a.clone(), 8, 0),
            Err(PlanError::ZeroGpusPerNode)
        ));
        assert!(matches!(
            ClusterSpec::new(a.clone(), 12, 8),
            Err(PlanError::GpusNotDivisibleByNode {
                gpus: 12,
                per_node: 8
            })
        ));
        // A partial single node (4 of 8 slots) is allowed.
        assert!(ClusterSpec::new(a, 4, 8).is_ok());
    }

    #[test]
    fn unknown_accelerator_lists_names() {
        let e = accelerator_preset("tpu-v9").unwrap_err().to_string();
        assert!(e.contains("tpu-v9") && e.contains("h100") && e.contains("cpu-2core"));
    }

    #[test]
    fn link_choice_follows_node_boundary() {
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 16, 8).unwrap();
        assert_eq!(c.link_for_span(8).0, 450e9);
        assert_eq!(c.link_for_span(16).0, 50e9);
    }
}
