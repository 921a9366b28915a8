//! Tests of the bench command's planning, merging and charts.

use super::*;
use crate::results::CollectiveRow;

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn available() -> Vec<String> {
    strings(&[
        "collectives",
        "dtensor",
        "fsdp",
        "fusion",
        "memory",
        "nccl",
        "nn",
        "train",
    ])
}

#[test]
fn no_suite_means_every_suite_in_order() {
    let args = parse_bench_args(&strings(&["--quick"]), &available()).expect("args");
    assert_eq!(
        args.suites,
        strings(&[
            "collectives",
            "dtensor",
            "nn",
            "fsdp",
            "fusion",
            "memory",
            "train"
        ])
    );
    assert!(args.quick && !args.compare_pytorch && !args.report_only);
    assert!(args.passthrough.is_empty());
    // A suite without a binary is left out of "all".
    let some = parse_bench_args(&[], &strings(&["nn", "collectives"])).expect("args");
    assert_eq!(some.suites, strings(&["collectives", "nn"]));
}

#[test]
fn one_suite_takes_the_remaining_arguments() {
    let args = parse_bench_args(
        &strings(&["fusion", "--reps", "3", "--compare-pytorch"]),
        &available(),
    )
    .expect("args");
    assert_eq!(args.suites, strings(&["fusion"]));
    assert!(args.compare_pytorch);
    assert_eq!(args.passthrough, strings(&["--reps", "3"]));
}

#[test]
fn bad_arguments_are_refused() {
    let unknown = parse_bench_args(&strings(&["gpu"]), &available()).unwrap_err();
    assert!(
        unknown.contains("unknown benchmark suite `gpu`"),
        "{unknown}"
    );
    let loose = parse_bench_args(&strings(&["--reps", "3"]), &available()).unwrap_err();
    assert!(loose.contains("need a suite"), "{loose}");
}

fn torch() -> TorchPython {
    TorchPython {
        python: PathBuf::from("/venv/bin/python"),
        venv: PathBuf::from("/venv"),
    }
}

#[test]
fn collectives_interleave_gloo_world_by_world() {
    let args = parse_bench_args(&strings(&["collectives"]), &available()).expect("args");
    let out = Path::new("/out");
    let steps = plan_suite("collectives", &args, Some(&torch()), out);
    let kinds: Vec<String> = steps
        .iter()
        .map(|s| match s {
            Step::Binary { args, .. } => format!("ours {} {}", args[1], args[3]),
            Step::Gloo { args, .. } => format!("gloo {}", args[1]),
        })
        .collect();
    assert_eq!(
        kinds,
        strings(&[
            "ours 2 tcp",
            "gloo 2",
            "ours 2 shm",
            "ours 4 tcp",
            "gloo 4",
            "ours 4 shm"
        ])
    );
    let Step::Gloo { csv, .. } = &steps[1] else {
        panic!("step 1 is gloo");
    };
    assert_eq!(csv, &out.join("gloo-w2.csv"));
    // Without torch, and quick: world 2 only, no gloo, `--quick` first.
    let quick = parse_bench_args(&strings(&["--quick"]), &available()).expect("args");
    let steps = plan_suite("collectives", &quick, None, out);
    assert_eq!(steps.len(), 2);
    let Step::Binary { args, .. } = &steps[0] else {
        panic!("ours");
    };
    assert_eq!(args[0], "--quick");
    assert!(args.ends_with(&strings(&["--json", "/out/collectives-tcp-w2.json"])));
}

#[test]
fn torch_suites_get_no_torch_unless_comparing() {
    let args = parse_bench_args(&strings(&["fsdp", "--steps", "3"]), &available()).expect("a");
    let plain = plan_suite("fsdp", &args, None, Path::new("/out"));
    assert_eq!(
        plain,
        vec![Step::Binary {
            bin: "bench-fsdp".into(),
            args: strings(&["--no-torch", "--steps", "3"]),
            torch_venv: None,
        }]
    );
    let with_torch = plan_suite("nn", &args, Some(&torch()), Path::new("/out"));
    assert_eq!(
        with_torch,
        vec![Step::Binary {
            bin: "bench-nn".into(),
            args: strings(&["--steps", "3"]),
            torch_venv: Some(PathBuf::from("/venv")),
        }]
    );
}

#[test]
fn the_memory_suite_finds_torch_like_the_fsdp_one() {
    let quick = parse_bench_args(&strings(&["memory", "--quick"]), &available()).expect("args");
    assert_eq!(
        plan_suite("memory", &quick, None, Path::new("/out")),
        vec![Step::Binary {
            bin: "bench-memory".into(),
            args: strings(&["--quick", "--no-torch"]),
            torch_venv: None,
        }]
    );
    let demo = parse_bench_args(&strings(&["memory", "--demo"]), &available()).expect("args");
    assert_eq!(
        plan_suite("memory", &demo, Some(&torch()), Path::new("/out")),
        vec![Step::Binary {
            bin: "bench-memory".into(),
            args: strings(&["--demo"]),
            torch_venv: Some(PathBuf::from("/venv")),
        }]
    );
}

#[test]
fn the_train_suite_gets_torch_only_when_asked() {
    let quick = parse_bench_args(&strings(&["train", "--quick"]), &available()).expect("args");
    assert_eq!(
        plan_suite("train", &quick, None, Path::new("/out")),
        vec![Step::Binary {
            bin: "bench-train".into(),
            args: strings(&["--quick", "--no-torch"]),
            torch_venv: None,
        }]
    );
    let full = parse_bench_args(&strings(&["train", "--reps", "2"]), &available()).expect("args");
    assert_eq!(
        plan_suite("train", &full, Some(&torch()), Path::new("/out")),
        vec![Step::Binary {
            bin: "bench-train".into(),
            args: strings(&["--reps", "2"]),
            torch_venv: Some(PathBuf::from("/venv")),
        }]
    );
}

#[test]
fn train_charts_show_ratios_and_peak_fractions() {
    let value: Value = serde_json::from_str(
        r#"{"cells":[
            {"preset":"small","mesh":"1","ratio":0.5,"ours_peak_fraction":0.1,"torch_peak_fraction":0.2},
            {"preset":"gpt2","mesh":"2x2","ratio":null,"ours_peak_fraction":0.3,"torch_peak_fraction":null}]}"#,
    )
    .expect("json");
    let charts = train_charts(&value);
    assert_eq!(charts.len(), 2);
    let (name, ratio) = &charts[0];
    assert_eq!(*name, "train-ratio.svg");
    assert_eq!(
        ratio.categories,
        strings(&["small 1 proc", "gpt2 HSDP 2x2"])
    );
    assert_eq!(ratio.series[0].values, vec![Some(0.5), None]);
    let (name, peak) = &charts[1];
    assert_eq!(*name, "train-peak.svg");
    assert_eq!(peak.series[0].values, vec![Some(10.0), Some(30.0)]);
    assert_eq!(peak.series[1].values, vec![Some(20.0), None]);
    // Ours only, no ratios: only the peak chart.
    let ours: Value = serde_json::from_str(
        r#"{"cells":[{"preset":"small","mesh":"2","ours_peak_fraction":0.1}]}"#,
    )
    .expect("json");
    let charts = train_charts(&ours);
    assert_eq!(charts.len(), 1);
    assert_eq!(charts[0].1.series.len(), 1);
    assert!(train_charts(&Value::Null).is_empty());
}

#[test]
fn merged_collectives_and_charts_come_from_the_files() {
    let dir = std::env::temp_dir().join(format!("xtask-bench-merge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let row = |backend: &str, bytes: usize| CollectiveRow {
        op: "all_gather".into(),
        backend: backend.into(),
        world: 2,
        bytes,
        median_us: 10.0,
        busbw_gbps: 1.5,
    };
    let tcp = dir.join("collectives-tcp-w2.json");
    let shm = dir.join("collectives-shm-w2.json");
    std::fs::write(
        &tcp,
        serde_json::to_string(&vec![row("tcp", 4096)]).expect("j"),
    )
    .expect("write");
    std::fs::write(
        &shm,
        serde_json::to_string(&vec![row("tcp+shm", 4096)]).expect("j"),
    )
    .expect("write");
    let gloo_csv = dir.join("gloo-w2.csv");
    std::fs::write(
        &gloo_csv,
        "world_size,op,bytes,median_us,busbw_GBps\n2,all_gather,4096,100,0.02\n",
    )
    .expect("write");
    let binary = |json: &Path| Step::Binary {
        bin: "bench-collectives".into(),
        args: strings(&["--json", &json.display().to_string()]),
        torch_venv: None,
    };
    let steps = vec![
        binary(&tcp),
        Step::Gloo {
            script: PathBuf::from("bench_gloo.py"),
            args: Vec::new(),
            csv: gloo_csv,
        },
        binary(&shm),
    ];
    merge_collectives(&dir, &steps).expect("merge");
    let merged = read_collectives(&dir.join("collectives.json")).expect("merged");
    assert_eq!(merged, vec![row("tcp", 4096), row("tcp+shm", 4096)]);
    let gloo = std::fs::read_to_string(dir.join("gloo.csv")).expect("gloo");
    assert_eq!(gloo.lines().count(), 2);

    let fsdp: Vec<Value> = serde_json::from_str(
        r#"[{"mode":"single","world":1,"median_ms":20.0},
            {"mode":"fsdp","world":2,"median_ms":30.0,"torch_median_ms":190.0},
            {"mode":"fusion_fused","world":2,"median_ms":1.0}]"#,
    )
    .expect("json");
    let chart = fsdp_chart(&fsdp).expect("chart");
    assert_eq!(
        chart.categories,
        strings(&["single (world 1)", "fsdp (world 2)"])
    );
    assert_eq!(chart.series.len(), 2);
    assert_eq!(chart.series[1].values, vec![None, Some(190.0)]);
    let fusion: Value = serde_json::from_str(
        r#"{"rows":[{"label":"100x4KiB AG","speedup":12.5},{"label":"no speedup"}]}"#,
    )
    .expect("json");
    let chart = fusion_chart(&fusion).expect("chart");
    assert_eq!(chart.categories, strings(&["100x4KiB AG"]));
    assert_eq!(chart.series[0].values, vec![Some(12.5)]);
}
