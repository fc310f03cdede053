//! Accelerator presets (peak dense bf16 FLOP/s, memory, bandwidths) and the
//! cluster shape (devices, devices per node, interconnect) with its validation.

use crate::PlanError;
use serde::Serialize;

/// GPUs are one tensor-parallel rank per device; a CPU machine runs its
/// tensor-parallel ranks as threads on its cores, sharing its memory and its
/// machine-wide bandwidth (see [`AcceleratorSpec::rank_memory_bandwidth`]).
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
    /// Main-memory (HBM/DRAM) read bandwidth, bytes/s: of the device, or of the
    /// whole CPU machine with all its cores streaming.
    pub memory_bandwidth: f64,
    /// CPU machines: read bandwidth one core draws on its own, bytes/s (one core
    /// cannot saturate memory). `None` means `memory_bandwidth / cores`, each
    /// core's share of the machine; GPUs leave it `None` and ignore it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_bandwidth_per_core: Option<f64>,
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
        memory_bandwidth_per_core: None,
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
        // 10 GbE between machines. One core cannot saturate its memory: read
        // streaming measured ~25 GB/s with 1 core and ~50 GB/s with 2 (STREAM
        // triad ~20 and ~34 GB/s), so each rank thread gets 25 GB/s at tp 1 and
        // tp 2 (the engine's batch-1 SmolLM2 decode at tp 2 is 1.67x tp 1).
        AcceleratorSpec {
            name: "cpu-2core".to_string(),
            kind: AcceleratorKind::CpuMachine { cores: 2 },
            peak_flops: 160e9,
            memory_bytes: 24.0 * GIB,
            memory_bandwidth: 50.0 * GB,
            memory_bandwidth_per_core: Some(25.0 * GB),
            gemm_efficiency: 1.0,
            default_intra_node_bandwidth: 25.0 * GB,
            default_inter_node_bandwidth: 1.25 * GB,
        },
    ]
}

impl AcceleratorSpec {
    /// Compute one tensor rank gets, FLOP/s: a GPU's calibrated peak, or on a
    /// CPU machine one core's share (fewer when `tp` threads outnumber the cores).
    pub fn rank_flops(&self, tp: u64) -> f64 {
        let flops = self.peak_flops * self.gemm_efficiency;
        match self.kind {
            AcceleratorKind::Gpu => flops,
            AcceleratorKind::CpuMachine { cores } => flops / cores.max(tp).max(1) as f64,
        }
    }

    /// This CPU machine with `n` cores: its FLOP/s and machine bandwidth scale with the
    /// cores, the per-core bandwidth stays. An error for a GPU or a count out of 1..=65536.
    pub fn with_cores(&self, n: u64) -> Result<AcceleratorSpec, PlanError> {
        let AcceleratorKind::CpuMachine { cores } = self.kind else {
            return Err(PlanError::InvalidCluster(format!(
                "cores per machine are for CPU machines; {} is a GPU",
                self.name
            )));
        };
        if n == 0 || n > 1 << 16 {
            return Err(PlanError::InvalidCluster(format!(
                "{n} cores per machine: give 1 to 65536"
            )));
        }
        let per_core = self
            .per_core_memory_bandwidth()
            .unwrap_or(self.memory_bandwidth);
        let scale = n as f64 / cores.max(1) as f64;
        Ok(AcceleratorSpec {
            name: format!("{}-as-{n}-core", self.name),
            kind: AcceleratorKind::CpuMachine { cores: n },
            peak_flops: self.peak_flops * scale,
            memory_bandwidth: (self.memory_bandwidth * scale).max(per_core),
            memory_bandwidth_per_core: Some(per_core),
            ..self.clone()
        })
    }

    /// Read bandwidth of one core of a CPU machine (`None` for a GPU).
    pub fn per_core_memory_bandwidth(&self) -> Option<f64> {
        match self.kind {
            AcceleratorKind::Gpu => None,
            AcceleratorKind::CpuMachine { cores } => Some(
                self.memory_bandwidth_per_core
                    .unwrap_or(self.memory_bandwidth / cores.max(1) as f64),
            ),
        }
    }

    /// Memory bandwidth each of `tp` concurrently streaming tensor ranks gets,
    /// bytes/s. A GPU rank owns its device's HBM. On a CPU machine the `tp`
    /// threads run on `min(tp, cores)` cores, which together draw
    /// `min(cores used × per-core, machine)`, split evenly: for `tp ≤ cores`
    /// each thread gets `min(per-core, machine / tp)`.
    pub fn rank_memory_bandwidth(&self, tp: u64) -> f64 {
        match self.kind {
            AcceleratorKind::Gpu => self.memory_bandwidth,
            AcceleratorKind::CpuMachine { cores } => {
                let tp = tp.max(1);
                let per_core = self
                    .per_core_memory_bandwidth()
                    .unwrap_or(self.memory_bandwidth);
                let drawn = (per_core * tp.min(cores.max(1)) as f64).min(self.memory_bandwidth);
                drawn / tp as f64
            }
        }
    }
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
        if let Some(per_core) = self.accelerator.memory_bandwidth_per_core {
            if !self.is_cpu() {
                return Err(PlanError::InvalidCluster(
                    "a per-core memory bandwidth is only meaningful for a CPU machine".to_string(),
                ));
            }
            if !(per_core.is_finite() && per_core > 0.0) {
                return Err(PlanError::InvalidCluster(
                    "the per-core memory bandwidth must be positive".to_string(),
                ));
            }
            if per_core > self.accelerator.memory_bandwidth {
                return Err(PlanError::InvalidCluster(format!(
                    "per-core memory bandwidth {:.1} GB/s exceeds the machine's {:.1} GB/s",
                    per_core / 1e9,
                    self.accelerator.memory_bandwidth / 1e9
                )));
            }
        }
        Ok(())
    }

    pub fn usable_memory_bytes(&self) -> f64 {
        self.accelerator.memory_bytes * self.usable_memory_fraction
    }

    /// Devices one tensor group of `tp` ranks occupies: `tp` GPUs; on CPU machines one
    /// machine while its cores can hold the rank threads, else `tp / cores` machines (one
    /// rank per core, a process per rank under mpirun; the search only offers multiples).
    pub fn devices_per_tensor_group(&self, tp: u64) -> u64 {
        match self.accelerator.kind {
            AcceleratorKind::Gpu => tp,
            AcceleratorKind::CpuMachine { cores } => tp.div_ceil(cores.max(1)).max(1),
        }
    }

    /// Tensor ranks of a group of `tp` that share one device: 1 per GPU; on CPU machines
    /// the threads on one machine (`min(tp, cores)`), what the per-rank FLOP/s and
    /// bandwidth of [`AcceleratorSpec::rank_flops`] / [`AcceleratorSpec::rank_memory_bandwidth`]
    /// are taken at.
    pub fn ranks_per_device(&self, tp: u64) -> u64 {
        match self.accelerator.kind {
            AcceleratorKind::Gpu => 1,
            AcceleratorKind::CpuMachine { cores } => tp.min(cores.max(1)).max(1),
        }
    }

    /// Rank slots one tensor group of `tp` takes when groups are laid side by side (pipeline
    /// stages, data-parallel replicas): `tp` on GPUs; on CPU machines whole machines of
    /// `cores` slots, so that two groups never share one.
    pub fn tensor_group_slots(&self, tp: u64) -> u64 {
        match self.accelerator.kind {
            AcceleratorKind::Gpu => tp,
            AcceleratorKind::CpuMachine { cores } => self.devices_per_tensor_group(tp) * cores,
        }
    }

    /// Bandwidth and latency for a collective whose group spans `group_span` consecutive
    /// rank slots: within a node (a GPU node, or one CPU machine's cores) the intra-node
    /// link, else the inter-node one.
    pub fn link_for_span(&self, group_span: u64) -> (f64, f64) {
        let per_node = match self.accelerator.kind {
            AcceleratorKind::Gpu => self.devices_per_node,
            AcceleratorKind::CpuMachine { cores } => cores,
        };
        if group_span <= per_node {
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
    fn cpu_rank_bandwidth_is_per_core_up_to_the_machine() {
        let cpu = accelerator_preset("cpu-2core").unwrap();
        assert_eq!(cpu.memory_bandwidth, 50e9);
        assert_eq!(cpu.per_core_memory_bandwidth(), Some(25e9));
        // tp 1: one core, 25 GB/s; tp 2: both cores, 25 GB/s each = the machine's 50.
        assert_eq!(cpu.rank_memory_bandwidth(1), 25e9);
        assert_eq!(cpu.rank_memory_bandwidth(2), 25e9);
        // Threads beyond the cores share them: the machine total over 4 threads.
        assert_eq!(cpu.rank_memory_bandwidth(4), 12.5e9);
        assert_eq!(cpu.rank_flops(2), 80e9);
        assert_eq!(cpu.rank_flops(4), 40e9);

        // 8 cores of 10 GB/s each on a 40 GB/s machine: saturated from tp 4 on.
        let mut big = cpu.clone();
        big.kind = AcceleratorKind::CpuMachine { cores: 8 };
        big.memory_bandwidth = 40e9;
        big.memory_bandwidth_per_core = Some(10e9);
        assert_eq!(big.rank_memory_bandwidth(2), 10e9);
        assert_eq!(big.rank_memory_bandwidth(4), 10e9);
        assert_eq!(big.rank_memory_bandwidth(8), 5e9);
        // Without a per-core figure each core gets its share of the machine.
        big.memory_bandwidth_per_core = None;
        assert_eq!(big.per_core_memory_bandwidth(), Some(5e9));
        assert_eq!(big.rank_memory_bandwidth(1), 5e9);

        // GPUs own their HBM at any tp and have no per-core figure.
        let gpu = accelerator_preset("h100").unwrap();
        assert_eq!(gpu.rank_memory_bandwidth(8), 3350e9);
        assert_eq!(gpu.per_core_memory_bandwidth(), None);
    }

    #[test]
    fn per_core_bandwidth_is_validated() {
        let mut cpu = accelerator_preset("cpu-2core").unwrap();
        cpu.memory_bandwidth_per_core = Some(60e9);
        assert!(matches!(
            ClusterSpec::new(cpu.clone(), 1, 1),
            Err(PlanError::InvalidCluster(_))
        ));
        cpu.memory_bandwidth_per_core = Some(0.0);
        assert!(ClusterSpec::new(cpu, 1, 1).is_err());
        let mut gpu = accelerator_preset("h100").unwrap();
        gpu.memory_bandwidth_per_core = Some(1e9);
        assert!(ClusterSpec::new(gpu, 8, 8).is_err());
    }

    #[test]
    fn link_choice_follows_node_boundary() {
        let c = ClusterSpec::new(accelerator_preset("h100").unwrap(), 16, 8).unwrap();
        assert_eq!(c.link_for_span(8).0, 450e9);
        assert_eq!(c.link_for_span(16).0, 50e9);
    }
}
