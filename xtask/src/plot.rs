//! The SVG plots of `cargo xtask bench` (plotters, SVG backend only): bus bandwidth against
//! message size, one plot per op and world size with one curve per backend and PyTorch gloo's
//! curve on the same axes; and grouped bar charts (FSDP step time by mode, ours against
//! FSDP2; the comm-fusion suite's fused against per-parameter times).

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::results::{CollectiveRow, GlooTable};

/// Our curve colours, one per backend in order of appearance; gloo is always black.
const PALETTE: [RGBColor; 5] = [BLUE, RED, GREEN, MAGENTA, CYAN];

fn human_bytes(bytes: f64) -> String {
    for (unit, factor) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        let factor = factor as f64;
        if bytes >= factor {
            let value = bytes / factor;
            return if (value - value.round()).abs() < 0.05 {
                format!("{} {unit}", value.round())
            } else {
                format!("{value:.1} {unit}")
            };
        }
    }
    format!("{bytes:.0} B")
}

/// The curves of one busbw plot: (label, points sorted by size).
type Curves = Vec<(String, Vec<(f64, f64)>)>;

/// The curves for `op` at `world`: ours per backend, then gloo's (labelled with its source).
pub fn busbw_curves(
    op: &str,
    world: usize,
    rows: &[CollectiveRow],
    gloo: Option<&GlooTable>,
) -> Curves {
    let mut by_backend: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for row in rows
        .iter()
        .filter(|r| r.op == op && r.world == world && r.busbw_gbps > 0.0)
    {
        by_backend
            .entry(row.backend.as_str())
            .or_default()
            .push((row.bytes as f64, row.busbw_gbps));
    }
    let mut curves: Curves = by_backend
        .into_iter()
        .map(|(backend, points)| (format!("hypershard {backend}"), points))
        .collect();
    if let Some(gloo) = gloo {
        let points: Vec<(f64, f64)> = gloo
            .cells
            .iter()
            .filter(|(key, cell)| key.op == op && key.world == world && cell.busbw_gbps > 0.0)
            .map(|(key, cell)| (key.bytes as f64, cell.busbw_gbps))
            .collect();
        if !points.is_empty() {
            curves.push((gloo.source.label().to_string(), points));
        }
    }
    for (_, points) in &mut curves {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    curves
}

fn plot_error(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> String + '_ {
    move |e| format!("plot {}: {e}", path.display())
}

/// Draws busbw against message size (both axes logarithmic) for `op` at `world`. Returns
/// `false` (and writes nothing) when there is no curve to draw.
pub fn plot_busbw(
    path: &Path,
    op: &str,
    world: usize,
    rows: &[CollectiveRow],
    gloo: Option<&GlooTable>,
) -> Result<bool, String> {
    let curves = busbw_curves(op, world, rows, gloo);
    let points = curves.iter().flat_map(|(_, p)| p.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        x_min = x_min.min(x);
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if curves.is_empty() || x_min > x_max {
        return Ok(false);
    }
    let fail = plot_error(path);
    let root = SVGBackend::new(path, (860, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    // Message sizes are powers of two: x is log2(bytes) on a linear axis, so the ticks fall
    // on powers of two (4 KiB, 64 KiB, ...) rather than powers of ten.
    let (x_lo, x_hi) = (x_min.log2() - 0.5, x_max.log2() + 0.5);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{op}, world {world}: bus bandwidth vs message size"),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(x_lo..x_hi, (y_min / 2.0..y_max * 2.0).log_scale())
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("message size (NCCL-tests convention)")
        .y_desc("busbw GB/s (log scale)")
        .x_labels(((x_hi - x_lo) as usize + 1).min(16))
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 {
                human_bytes(2f64.powf(x.round()))
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(|e| fail(&e))?;
    let mut ours = 0;
    for (label, points) in curves {
        let color = if label.starts_with("PyTorch") {
            BLACK
        } else {
            ours += 1;
            PALETTE[(ours - 1) % PALETTE.len()]
        };
        let points: Vec<(f64, f64)> = points.into_iter().map(|(x, y)| (x.log2(), y)).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(
                points
                    .into_iter()
                    .map(move |p| Circle::new(p, 3, color.filled())),
            )
            .map_err(|e| fail(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(true)
}

/// One series of a grouped bar chart: a value (or none) per category.
#[derive(Clone, Debug)]
pub struct BarSeries {
    /// The legend label.
    pub label: String,
    /// One entry per category; `None` leaves a gap.
    pub values: Vec<Option<f64>>,
}

/// A grouped bar chart: one group of bars per category, one bar per series in each group.
#[derive(Clone, Debug)]
pub struct BarChart {
    /// The caption.
    pub title: String,
    /// What the bars' length measures (the value axis).
    pub y_desc: String,
    /// The category names, one group of bars each.
    pub categories: Vec<String>,
    /// The series, drawn side by side in each category.
    pub series: Vec<BarSeries>,
}

/// Draws `chart` into an SVG at `path` as horizontal bars (category names on the left, read
/// top to bottom, so long names stay legible). Returns `false` (and writes nothing) when it
/// has no value to draw.
pub fn plot_bars(path: &Path, chart: &BarChart) -> Result<bool, String> {
    let x_max = chart
        .series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    if chart.categories.is_empty() || x_max <= 0.0 {
        return Ok(false);
    }
    let fail = plot_error(path);
    let n = chart.categories.len();
    let groups = chart.series.len().max(1);
    let longest = chart.categories.iter().map(|c| c.len()).max().unwrap_or(0) as u32;
    let height = 140 + (n * groups) as u32 * 22;
    let root = SVGBackend::new(path, (900, height.max(320))).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    // Category i sits at y = n - 1 - i, so the first category is at the top; the value axis
    // runs to 1.5 × the longest bar so the legend (upper right) covers no bar.
    let mut plot = ChartBuilder::on(&root)
        .caption(&chart.title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(20 + 7 * longest)
        .build_cartesian_2d(0.0..x_max * 1.5, -0.5f64..(n as f64 - 0.5))
        .map_err(|e| fail(&e))?;
    let categories = chart.categories.clone();
    plot.configure_mesh()
        .disable_y_mesh()
        .y_labels(n + 1)
        .y_label_formatter(&|y| {
            let index = y.round();
            if (y - index).abs() < 1e-6 && index >= 0.0 && (index as usize) < n {
                categories[n - 1 - index as usize].clone()
            } else {
                String::new()
            }
        })
        .x_desc(chart.y_desc.as_str())
        .draw()
        .map_err(|e| fail(&e))?;
    let height_per_bar = 0.8 / groups as f64;
    for (s, series) in chart.series.iter().enumerate() {
        let color = PALETTE[s % PALETTE.len()];
        let top = 0.4 - s as f64 * height_per_bar;
        let bars = series.values.iter().enumerate().filter_map(move |(c, v)| {
            let v = (*v)?;
            let y0 = (n - 1 - c) as f64 + top;
            Some(Rectangle::new(
                [(0.0, y0), (v, y0 - height_per_bar * 0.9)],
                color.filled(),
            ))
        });
        plot.draw_series(bars)
            .map_err(|e| fail(&e))?
            .label(series.label.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    plot.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::{CellKey, GlooCell, GlooSource};
    use std::path::PathBuf;

    fn row(backend: &str, bytes: usize, busbw: f64) -> CollectiveRow {
        CollectiveRow {
            op: "all_reduce".into(),
            backend: backend.into(),
            world: 2,
            bytes,
            median_us: 1.0,
            busbw_gbps: busbw,
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir.join(name)
    }

    fn gloo() -> GlooTable {
        let mut cells = BTreeMap::new();
        for (bytes, busbw) in [(4096usize, 0.01), (1 << 20, 1.2)] {
            cells.insert(
                CellKey {
                    op: "all_reduce".into(),
                    world: 2,
                    bytes,
                },
                GlooCell {
                    median_us: 100.0,
                    busbw_gbps: busbw,
                },
            );
        }
        GlooTable {
            source: GlooSource::SameSitting(PathBuf::from("gloo.csv")),
            cells,
        }
    }

    #[test]
    fn curves_are_grouped_by_backend_sorted_and_gloo_last() {
        let rows = vec![
            row("tcp", 1 << 20, 2.0),
            row("tcp", 4096, 0.05),
            row("tcp+shm", 4096, 0.1),
            // Another op and another world stay out of this plot.
            CollectiveRow {
                op: "broadcast".into(),
                ..row("tcp", 8192, 1.0)
            },
            CollectiveRow {
                world: 4,
                ..row("tcp", 8192, 1.0)
            },
        ];
        let curves = busbw_curves("all_reduce", 2, &rows, Some(&gloo()));
        let labels: Vec<&str> = curves.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(
            labels,
            [
                "hypershard tcp",
                "hypershard tcp+shm",
                "PyTorch gloo (interleaved runs)"
            ]
        );
        assert_eq!(curves[0].1, vec![(4096.0, 0.05), (1048576.0, 2.0)]);
        assert_eq!(curves[2].1, vec![(4096.0, 0.01), (1048576.0, 1.2)]);
    }

    #[test]
    fn the_busbw_plot_is_an_svg_with_every_curve() {
        let path = scratch("busbw.svg");
        let rows = vec![row("tcp", 4096, 0.05), row("tcp", 1 << 20, 2.0)];
        assert!(plot_busbw(&path, "all_reduce", 2, &rows, Some(&gloo())).expect("plot"));
        let svg = std::fs::read_to_string(&path).expect("svg");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("hypershard tcp") && svg.contains("PyTorch gloo (interleaved runs)"));
        assert!(svg.contains("all_reduce, world 2"));
        assert!(svg.matches("<polyline").count() >= 2, "{svg}");
        // Nothing to draw: no file, and the caller is told.
        let empty = scratch("empty.svg");
        assert!(!plot_busbw(&empty, "all_gather", 2, &rows, None).expect("plot"));
        assert!(!empty.exists());
    }

    #[test]
    fn the_bar_chart_names_its_categories_and_series() {
        let path = scratch("bars.svg");
        let chart = BarChart {
            title: "FSDP step time by mode".into(),
            y_desc: "ms".into(),
            categories: vec!["single".into(), "fsdp".into(), "hsdp".into()],
            series: vec![
                BarSeries {
                    label: "hypershard".into(),
                    values: vec![Some(20.0), Some(30.0), Some(60.0)],
                },
                BarSeries {
                    label: "PyTorch FSDP2".into(),
                    values: vec![Some(27.0), Some(190.0), None],
                },
            ],
        };
        assert!(plot_bars(&path, &chart).expect("plot"));
        let svg = std::fs::read_to_string(&path).expect("svg");
        for text in ["single", "fsdp", "hsdp", "hypershard", "PyTorch FSDP2"] {
            assert!(svg.contains(text), "{text} missing");
        }
        // Five bars plus two legend swatches and the background.
        assert!(svg.matches("<rect").count() >= 7, "{svg}");
    }
}
