//! The loss curve as a standalone SVG (no plotting dependency): loss per step, a smoothed
//! line, axes with ticks, written beside the checkpoints as `loss.svg`.

use std::fmt::Write;

pub const PLOT_FILE: &str = "loss.svg";

/// "Nice" tick values covering `lo..=hi` (about `n` of them).
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= n as f64)
        .unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG plot of `(step, loss)` points.
pub fn loss_svg(points: &[(u64, f64)], title: &str) -> String {
    let (w, h) = (720.0, 420.0);
    let (left, right, top, bottom) = (64.0, 20.0, 40.0, 48.0);
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|(_, l)| l.is_finite())
        .map(|&(s, l)| (s as f64, l))
        .collect();
    let (x0, x1) = match (pts.first(), pts.last()) {
        (Some(a), Some(b)) if b.0 > a.0 => (a.0, b.0),
        (Some(a), _) => (a.0 - 1.0, a.0 + 1.0),
        _ => (0.0, 1.0),
    };
    let lmin = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let lmax = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let (y0, y1) = if lmin.is_finite() && lmax > lmin {
        (lmin - 0.05 * (lmax - lmin), lmax + 0.05 * (lmax - lmin))
    } else if lmin.is_finite() {
        (lmin - 0.5, lmin + 0.5)
    } else {
        (0.0, 1.0)
    };
    let px = |x: f64| left + (x - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| top + (y1 - y) / (y1 - y0) * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">training loss: {}</text>"#,
        w / 2.0,
        escape(title)
    );
    for t in ticks(y0, y1, 6) {
        let y = py(t);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{t:.2}</text>"##,
            w - right,
            left - 6.0,
            y + 4.0
        );
    }
    for t in ticks(x0, x1, 8) {
        let x = px(t);
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{t:.0}</text>"##,
            h - bottom,
            h - bottom + 16.0
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{left}" y="{top}" width="{:.1}" height="{:.1}" fill="none" stroke="black"/>"#,
        w - left - right,
        h - top - bottom
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text><text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">cross-entropy (nats/token)</text>"#,
        (left + w - right) / 2.0,
        h - 8.0,
        (top + h - bottom) / 2.0,
        (top + h - bottom) / 2.0
    );
    let line = |pts: &[(f64, f64)]| -> String {
        pts.iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#9ecae1" stroke-width="1" points="{}"/>"##,
        line(&pts)
    );
    // Debiased exponential moving average (as TensorBoard smooths), about n/20 steps wide.
    let beta = (1.0 - 20.0 / pts.len().max(1) as f64).clamp(0.0, 0.98);
    let mut ema = Vec::with_capacity(pts.len());
    let (mut acc, mut weight) = (0f64, 0f64);
    for &(x, y) in &pts {
        acc = beta * acc + (1.0 - beta) * y;
        weight = beta * weight + (1.0 - beta);
        ema.push((x, acc / weight));
    }
    let _ = writeln!(
        s,
        r##"<polyline fill="none" stroke="#08519c" stroke-width="2" points="{}"/>"##,
        line(&ema)
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="end" fill="#6baed6">per step</text><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#08519c">smoothed</text>"##,
        w - right - 8.0,
        top + 16.0,
        w - right - 8.0,
        top + 32.0
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_both_lines_and_nice_ticks() {
        let pts: Vec<(u64, f64)> = (1..=50).map(|s| (s, 5.0 / (s as f64).sqrt())).collect();
        let svg = loss_svg(&pts, "tiny <bytes>");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("tiny &lt;bytes&gt;"));
        let t = ticks(0.0, 1.0, 5);
        assert_eq!(t.len(), 6);
        assert!(t
            .iter()
            .zip([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
            .all(|(a, b)| (a - b).abs() < 1e-9));
        // Degenerate inputs still give a valid document.
        assert!(loss_svg(&[], "x").contains("</svg>"));
        assert!(loss_svg(&[(3, 1.0)], "x").contains("</svg>"));
    }
}
