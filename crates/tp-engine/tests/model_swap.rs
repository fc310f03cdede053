//! Holding a second model beside the live one at tp 2 (rank threads): a model loaded in the
//! background, adopted and selected gives the logits of a worker started on it, bit for bit
//! (same layout, same kernels: the oracle is that fresh worker); the first model's open
//! sequence continues untouched once selected back; a path that is no model is refused on
//! every rank with the loader's words and changes nothing; a dropped model is gone.
//! A replacement in place (a drain swap) frees the only model and loads another: its logits
//! are the fresh worker's; one that fails on the ranks leaves no model (steps refused) until
//! a replacement succeeds.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tp_engine::{ChunkSpec, Command, ReloadSpec, StepExecutor, Worker};
use tp_models::synthetic::{GgufTypes, SyntheticModel};
use tp_models::{open_checkpoint, Arch, LoadOptions, RankWeights, SyncMode};

const TP: usize = 2;
const CTX: usize = 128;

/// A synthetic model of `seed` written to `dir`.
fn write_model(dir: &Path, seed: u64) -> PathBuf {
    let path = dir.join(format!("m{seed}.gguf"));
    SyntheticModel::new(SyntheticModel::small(Arch::Llama, 7).cfg, seed)
        .write_gguf(&path, GgufTypes::F32)
        .unwrap();
    path
}

/// Runs `lead` on rank 0's worker of `path` at tp 2, reload enabled.
fn on_workers<T: Send>(path: &Path, lead: impl Fn(&mut Worker) -> T + Sync) -> T {
    let ckpt = open_checkpoint(path).unwrap();
    let reload = |w: &mut Worker| {
        w.enable_reload(ReloadSpec {
            weights: RankWeights::even(TP),
            load: LoadOptions::default(),
            ctx: CTX,
            sync: SyncMode::Exact,
            deadline: Duration::from_secs(30),
        })
    };
    common::on_set_workers(&*ckpt, TP, LoadOptions::default(), CTX, reload, lead)
}

fn forward(w: &mut Worker, slot: u32, tokens: &[u32]) -> Vec<u32> {
    let logits = w
        .submit(Command::Forward(vec![ChunkSpec::new(
            slot,
            tokens.to_vec(),
        )]))
        .unwrap()
        .unwrap();
    logits.iter().map(|x| x.to_bits()).collect()
}

/// The logits of `tokens` then `next` on a fresh worker of `path`.
fn oracle(path: &Path, tokens: &[u32], next: u32) -> (Vec<u32>, Vec<u32>) {
    on_workers(path, |w| {
        w.submit(Command::Open {
            slot: 0,
            capacity: 64,
        })
        .unwrap();
        (forward(w, 0, tokens), forward(w, 0, &[next]))
    })
}

/// Loads `path` as `id` and adopts it once rank 0 has loaded (bounded wait).
fn load(w: &mut Worker, id: u32, path: &Path) -> Result<(), String> {
    w.load_model(id, path.to_str().unwrap()).unwrap();
    let t0 = Instant::now();
    while !StepExecutor::load_finished(w) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the load never ended"
        );
        // Followers keep following while they load.
        w.submit(Command::Idle).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    w.adopt_model(id).unwrap()
}

#[test]
fn a_second_model_is_held_selected_and_dropped_beside_the_first() {
    let dir = std::env::temp_dir().join(format!("tp-swap-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = write_model(&dir, 7);
    let b = write_model(&dir, 8);
    let prompt = [5u32, 9, 2, 77, 31];
    let (a1, a2) = oracle(&a, &prompt, 12);
    let (b1, b2) = oracle(&b, &prompt, 12);
    assert_ne!(
        a1, b1,
        "the two models must differ for the test to mean anything"
    );
    let missing = dir.join("no-such-model.gguf");
    let not_model = dir.join("notes.txt");
    std::fs::write(&not_model, "not a model").unwrap();
    on_workers(&a, |w| {
        w.submit(Command::Open {
            slot: 0,
            capacity: 64,
        })
        .unwrap();
        assert_eq!(forward(w, 0, &prompt), a1);
        load(w, 1, &b).unwrap();
        assert_eq!(w.held_models(), vec![0, 1]);
        assert_eq!(w.selected_model(), 0);
        w.select_model(1).unwrap();
        // Model 1 has its own slots: slot 0 is free there.
        w.submit(Command::Open {
            slot: 0,
            capacity: 64,
        })
        .unwrap();
        assert_eq!(forward(w, 0, &prompt), b1);
        assert_eq!(forward(w, 0, &[12]), b2);
        // Back on model 0, its sequence goes on where it stopped.
        w.select_model(0).unwrap();
        assert_eq!(forward(w, 0, &[12]), a2);
        // Bad paths: every rank refuses, the loader's words come back, nothing changes.
        for (id, bad, words) in [
            (2, &missing, "does not exist"),
            (3, &not_model, "notes.txt"),
        ] {
            let e = load(w, id, bad).unwrap_err();
            assert!(e.contains(words), "{e}");
            assert_eq!(w.held_models(), vec![0, 1]);
        }
        // The leader refuses what would desynchronize ranks, before sending it.
        assert!(w.select_model(9).is_err());
        assert!(
            w.drop_model(0).is_err(),
            "the selected model cannot be dropped"
        );
        w.drop_model(1).unwrap();
        assert_eq!(w.held_models(), vec![0]);
        assert!(w.select_model(1).is_err());
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_replaced_in_place_serves_like_a_fresh_worker_and_a_failed_replace_holds_none() {
    let dir = std::env::temp_dir().join(format!("tp-replace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = write_model(&dir, 7);
    let b = write_model(&dir, 8);
    let prompt = [5u32, 9, 2, 77, 31];
    let (a1, _) = oracle(&a, &prompt, 12);
    let (b1, b2) = oracle(&b, &prompt, 12);
    assert_ne!(a1, b1);
    let missing = dir.join("no-such-model.gguf");
    let open = |w: &mut Worker| {
        w.submit(Command::Open {
            slot: 0,
            capacity: 64,
        })
    };
    on_workers(&a, |w| {
        open(w).unwrap();
        assert_eq!(forward(w, 0, &prompt), a1);
        // Not with a sequence open, nor with another model held.
        assert!(w.replace_model(1, b.to_str().unwrap()).is_err());
        w.submit(Command::Close { slot: 0 }).unwrap();
        load(w, 1, &b).unwrap();
        assert!(w.replace_model(2, b.to_str().unwrap()).is_err());
        w.drop_model(1).unwrap();
        // B in A's place: B's logits, model 2 the only one.
        w.replace_model(2, b.to_str().unwrap()).unwrap().unwrap();
        assert_eq!((w.held_models(), w.selected_model()), (vec![2], 2));
        open(w).unwrap();
        assert_eq!(forward(w, 0, &prompt), b1);
        assert_eq!(forward(w, 0, &[12]), b2);
        w.submit(Command::Close { slot: 0 }).unwrap();
        // A path that fails on every rank: no model is held, steps are refused.
        let e = w
            .replace_model(3, missing.to_str().unwrap())
            .unwrap()
            .unwrap_err();
        assert!(e.contains("does not exist"), "{e}");
        assert!(open(w).is_err());
        // Loading back works: A's logits again.
        w.replace_model(4, a.to_str().unwrap()).unwrap().unwrap();
        open(w).unwrap();
        assert_eq!(forward(w, 0, &prompt), a1);
    });
    let _ = std::fs::remove_dir_all(&dir);
}
