//! Rank weights for uneven hosts from their measured speeds (`tp plan --host-speeds`): the
//! smallest whole-number weights whose shares are within two percentage points of the speeds'
//! shares, for the model commands' `--rank-weights`. Decode time on a rank is its shard over
//! its speed, so shares proportional to speed finish together.

use crate::PlanError;

/// The largest weight suggested (the model commands accept up to 1000).
pub const MAX_SUGGESTED_WEIGHT: u32 = 1000;

/// Shares are close enough when no rank's share is off by more than this (a fraction).
const TOLERANCE: f64 = 0.02;

/// `25,12.5`-style speeds: positive finite numbers separated by commas, one per host in rank
/// order. Errors name the offending entry.
pub fn parse_speeds(text: &str) -> Result<Vec<f64>, PlanError> {
    let mut speeds = Vec::new();
    for (i, part) in text.split(',').enumerate() {
        let part = part.trim();
        match part.parse::<f64>() {
            Ok(s) if s.is_finite() && s > 0.0 => speeds.push(s),
            _ => {
                return Err(PlanError::InvalidWorkload(format!(
                    "host speed {i} is `{}`; give one positive number per host, like 25,12",
                    part.chars().take(32).collect::<String>()
                )))
            }
        }
    }
    if speeds.len() > MAX_SUGGESTED_WEIGHT as usize {
        return Err(PlanError::InvalidWorkload(format!(
            "{} host speeds; at most {MAX_SUGGESTED_WEIGHT} hosts",
            speeds.len()
        )));
    }
    Ok(speeds)
}

/// The suggested weights (reduced by their common divisor) and the largest share error.
pub fn suggest(speeds: &[f64]) -> Result<(Vec<u32>, f64), PlanError> {
    let fastest = speeds.iter().copied().fold(0.0f64, f64::max);
    let total: f64 = speeds.iter().sum();
    if speeds.is_empty() || !(fastest > 0.0 && total.is_finite()) {
        return Err(PlanError::InvalidWorkload(
            "give one positive speed per host".to_string(),
        ));
    }
    let error = |w: &[u32]| {
        let sum: f64 = w.iter().map(|&x| f64::from(x)).sum();
        w.iter()
            .zip(speeds)
            .map(|(&x, s)| (f64::from(x) / sum - s / total).abs())
            .fold(0.0, f64::max)
    };
    let mut best: Option<(Vec<u32>, f64)> = None;
    for top in 1..=MAX_SUGGESTED_WEIGHT {
        let w: Vec<u32> = speeds
            .iter()
            .map(|s| ((s / fastest * f64::from(top)).round() as u32).clamp(1, top))
            .collect();
        let e = error(&w);
        if best.as_ref().is_none_or(|(_, b)| e < *b) {
            best = Some((w, e));
        }
        if e <= TOLERANCE {
            break;
        }
    }
    let (w, e) = best.unwrap_or_else(|| (vec![1; speeds.len()], 0.0));
    let g = w.iter().copied().fold(0, gcd).max(1);
    Ok((w.iter().map(|x| x / g).collect(), e))
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The text `tp plan --host-speeds` prints.
pub fn report(speeds: &[f64]) -> Result<String, PlanError> {
    let (w, e) = suggest(speeds)?;
    let total: f64 = speeds.iter().sum();
    let sum: f64 = w.iter().map(|&x| f64::from(x)).sum();
    let list = |v: Vec<String>| v.join(",");
    let weights = list(w.iter().map(u32::to_string).collect());
    let shares = |v: Vec<f64>| list(v.iter().map(|x| format!("{:.1}%", x * 100.0)).collect());
    Ok(format!(
        "host speeds {}: shares {}\n--rank-weights {weights}: shares {} (largest difference {:.1} points)\n\
         run: tp generate --tp {} --rank-weights {weights} ... (under mpirun, list the hosts in rank order: a hostfile with slots=1)\n",
        list(speeds.iter().map(|s| s.to_string()).collect()),
        shares(speeds.iter().map(|s| s / total).collect()),
        shares(w.iter().map(|&x| f64::from(x) / sum).collect()),
        e * 100.0,
        w.len(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smallest_weights_within_two_points() {
        assert_eq!(suggest(&[25.0, 12.0]).unwrap().0, vec![2, 1]);
        assert_eq!(suggest(&[12.0, 25.0]).unwrap().0, vec![1, 2]);
        assert_eq!(suggest(&[1.0, 1.0, 1.0]).unwrap().0, vec![1, 1, 1]);
        assert_eq!(suggest(&[3.0, 2.0, 1.0]).unwrap().0, vec![3, 2, 1]);
        assert_eq!(suggest(&[7.0]).unwrap().0, vec![1]);
        // 10:7 cannot be hit with small weights: 3,2 is 60/40 vs 58.8/41.2, within 2 points.
        let (w, e) = suggest(&[10.0, 7.0]).unwrap();
        assert_eq!(w, vec![3, 2]);
        assert!(e <= 0.02, "{e}");
        // A very slow host still gets weight 1 and the error says how far off that is.
        let (w, e) = suggest(&[10000.0, 1.0]).unwrap();
        assert_eq!(w[1], 1);
        assert!(w[0] <= MAX_SUGGESTED_WEIGHT && e <= TOLERANCE, "{w:?} {e}");
    }

    #[test]
    fn speeds_are_parsed_and_bad_ones_named() {
        assert_eq!(parse_speeds("25, 12.5").unwrap(), vec![25.0, 12.5]);
        for bad in ["", "1,", "a", "0,1", "-1,2", "inf,1", "NaN"] {
            let e = parse_speeds(bad).unwrap_err().to_string();
            assert!(
                e.contains("give one positive number per host"),
                "{bad}: {e}"
            );
        }
        let r = report(&[25.0, 12.0]).unwrap();
        assert!(r.contains("--rank-weights 2,1: shares 66.7%,33.3%"), "{r}");
    }
}
