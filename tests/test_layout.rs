//! Every package with a `tests/main.rs` builds its integration tests as that one binary
//! (`autotests = false` in its Cargo.toml), so a test file it does not declare as a module would
//! never be compiled nor run. This test catches such a file.

use std::path::Path;

#[test]
fn every_test_file_is_a_module_of_its_packages_test_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    let packages = std::iter::once(root.to_path_buf()).chain(
        std::fs::read_dir(root)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("Cargo.toml").is_file()),
    );
    for package in packages {
        let tests = package.join("tests");
        let Ok(main) = std::fs::read_to_string(tests.join("main.rs")) else {
            continue;
        };
        let manifest = std::fs::read_to_string(package.join("Cargo.toml")).unwrap();
        assert!(
            manifest.contains("autotests = false"),
            "{}: a tests/main.rs without `autotests = false` builds every file twice",
            package.display()
        );
        for e in std::fs::read_dir(&tests).unwrap() {
            let path = e.unwrap().path();
            let name = if path.extension().is_some_and(|x| x == "rs") {
                path.file_stem()
            } else if path.join("mod.rs").is_file() {
                path.file_name()
            } else {
                continue;
            };
            let name = name.unwrap().to_str().unwrap();
            if name == "main" {
                continue;
            }
            let declared = main.lines().any(|l| l.trim() == format!("mod {name};"));
            assert!(
                declared,
                "{} is not a module of {}: add `mod {name};` there",
                path.display(),
                tests.join("main.rs").display()
            );
            checked += 1;
        }
    }
    assert!(
        checked > 0,
        "no tests/main.rs found under {}",
        root.display()
    );
}
