//! The workspace's one seeded random generator: the sampler's `--seed`, the synthetic models'
//! weights, the training initialisation and data order, and the tests' data all draw from
//! [`Rng`]. The same seed gives the same values on every platform and run.
//!
//! Two algorithms, because both streams are pinned by what users see (sampled text, trained
//! weights, checkpoints) and by tests:
//! - SplitMix64 (Steele, Lea and Flood, 2014; Vigna's `splitmix64.c`), [`Rng::new`]: any seed,
//!   zero included, starts a full-period stream. The sampler, the synthetic models, the data
//!   order and the tests use it.
//! - xorshift64* (Vigna, 2016) started from a scrambled seed, [`Rng::xorshift64_star`]: the
//!   stream of tp-nn's random block weights and of tp-train's initialisation.

/// Weyl increment of SplitMix64 (2^64 / golden ratio), also the seed scrambler of xorshift64*.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Algorithm {
    SplitMix64,
    XorShift64Star,
}

/// A seeded stream of pseudo-random numbers (see the module documentation).
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    algorithm: Algorithm,
}

impl Rng {
    /// A SplitMix64 stream.
    pub fn new(seed: u64) -> Rng {
        Rng {
            state: seed,
            algorithm: Algorithm::SplitMix64,
        }
    }

    /// An xorshift64* stream (shifts 12, 25, 27; multiplier 0x2545F4914F6CDD1D) whose state
    /// starts at `seed * GOLDEN_GAMMA | 1`, so every seed gives a nonzero state.
    pub fn xorshift64_star(seed: u64) -> Rng {
        Rng {
            state: seed.wrapping_mul(GOLDEN_GAMMA) | 1,
            algorithm: Algorithm::XorShift64Star,
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        match self.algorithm {
            Algorithm::SplitMix64 => {
                self.state = self.state.wrapping_add(GOLDEN_GAMMA);
                let mut z = self.state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^ (z >> 31)
            }
            Algorithm::XorShift64Star => {
                self.state ^= self.state >> 12;
                self.state ^= self.state << 25;
                self.state ^= self.state >> 27;
                self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
            }
        }
    }

    /// A value in `0..n` (0 when `n` is 0); the modulo bias is negligible for the sizes used.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An f32 uniform in `[-1, 1)` from the top 24 bits (every value exact in f32).
    pub fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// An f32 uniform in `[lo, hi)`, from the top 24 bits.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }

    /// `len` values of [`Rng::uniform`].
    pub fn uniform_vec(&mut self, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(lo, hi)).collect()
    }

    /// An f64 uniform in `[0, 1)` from the top 53 bits.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The first SplitMix64 output of `x`: a stateless 64-bit hash (the training data order).
pub fn mix64(x: u64) -> u64 {
    Rng::new(x).next_u64()
}

#[cfg(test)]
mod tests {
    use super::{mix64, Rng};

    #[test]
    fn splitmix64_reference_values() {
        // The first outputs for seed 1234567 of the reference C implementation (Vigna's
        // splitmix64.c).
        let mut r = Rng::new(1234567);
        assert_eq!(r.next_u64(), 6457827717110365317);
        assert_eq!(r.next_u64(), 3203168211198807973);
        assert_eq!(r.next_u64(), 9817491932198370423);
        assert_eq!(mix64(1234567), 6457827717110365317);
    }

    /// xorshift64* written out independently (Vigna, "An experimental exploration of
    /// Marsaglia's xorshift generators, scrambled", 2016, Fig. 10: A1=12, A2=25, A3=27).
    #[test]
    fn xorshift64_star_matches_its_definition() {
        for seed in [0u64, 1, 7, 99, u64::MAX] {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut r = Rng::xorshift64_star(seed);
            for _ in 0..100 {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                assert_eq!(r.next_u64(), x.wrapping_mul(2685821657736338717));
            }
        }
    }

    #[test]
    fn same_seed_same_stream_other_seed_other_stream() {
        for make in [Rng::new, Rng::xorshift64_star] {
            let draw = |seed| -> Vec<u64> {
                let mut r = make(seed);
                (0..4).map(|_| r.next_u64()).collect()
            };
            assert_eq!(draw(7), draw(7));
            assert_ne!(draw(7), draw(8));
        }
        assert_ne!(Rng::new(7).next_u64(), Rng::xorshift64_star(7).next_u64());
    }

    #[test]
    fn floats_stay_in_range_and_spread() {
        let v = Rng::new(0).uniform_vec(10_000, -0.5, 0.5);
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!(v.iter().any(|&x| x < -0.45) && v.iter().any(|&x| x > 0.45));
        let mut r = Rng::new(3);
        assert!((0..1000).all(|_| r.below(7) < 7));
        assert_eq!(r.below(0), 0);
        let mut r = Rng::xorshift64_star(5);
        let s: Vec<f32> = (0..10_000).map(|_| r.signed_unit()).collect();
        assert!(s.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(s.iter().any(|&x| x < -0.9) && s.iter().any(|&x| x > 0.9));
        let u: Vec<f64> = (0..10_000).map(|_| r.unit_f64()).collect();
        assert!(u.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = u.iter().sum::<f64>() / u.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }

    /// The float mappings are the ones the streams' users pinned before they shared this type:
    /// `signed_unit` is `uniform(-1, 1)` exactly (both exact in f32).
    #[test]
    fn signed_unit_is_uniform_minus_one_to_one() {
        let (mut a, mut b) = (Rng::new(11), Rng::new(11));
        for _ in 0..1000 {
            assert_eq!(a.signed_unit().to_bits(), b.uniform(-1.0, 1.0).to_bits());
        }
    }
}
