//! `OUT/loss.svg`: the training loss per step (and the evaluation loss, if any).

use std::path::Path;

use plotters::prelude::*;

use crate::error::{Error, Result};

/// Draws the loss curves into an SVG file at `path`.
pub fn plot_losses(path: &Path, train: &[(u64, f64)], eval: &[(u64, f64)]) -> Result<()> {
    let plot_error = |e: &dyn std::fmt::Display| Error::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let finite = |points: &[(u64, f64)]| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter(|(_, l)| l.is_finite())
            .map(|(s, l)| (*s as f64, *l))
            .collect()
    };
    let (train, eval) = (finite(train), finite(eval));
    let all = train.iter().chain(eval.iter());
    let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for (x, y) in all {
        x_max = x_max.max(*x);
        y_min = y_min.min(*y);
        y_max = y_max.max(*y);
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.0, 1.0);
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| plot_error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("hypershard train: loss", ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(0.0..x_max, (y_min - pad)..(y_max + pad))
        .map_err(|e| plot_error(&e))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy")
        .draw()
        .map_err(|e| plot_error(&e))?;
    chart
        .draw_series(LineSeries::new(train, &BLUE))
        .map_err(|e| plot_error(&e))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
    if !eval.is_empty() {
        chart
            .draw_series(LineSeries::new(eval, &RED))
            .map_err(|e| plot_error(&e))?
            .label("eval")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| plot_error(&e))?;
    root.present().map_err(|e| plot_error(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_both_curves() {
        let dir = std::env::temp_dir().join(format!("hypershard-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("loss.svg");
        let train: Vec<(u64, f64)> = (0..20).map(|s| (s, 5.0 / (1.0 + s as f64))).collect();
        plot_losses(&path, &train, &[(10, 1.0), (19, 0.5)]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("train") && svg.contains("eval"));
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
    }
}
