//! With the `link` feature: finds the system UCX with pkg-config (which also emits the link flags
//! for libucp, libucs and their companions) and generates bindings for the ucp/ucs API from its
//! headers. Without it: nothing, so the crate builds on machines without UCX.

fn main() {
    #[cfg(feature = "link")]
    link::bind();
}

#[cfg(feature = "link")]
mod link {
    use std::path::PathBuf;

    pub fn bind() {
        println!("cargo:rerun-if-changed=wrapper.h");
        let ucx = pkg_config::Config::new()
            .atleast_version("1.12")
            .probe("ucx")
            .unwrap_or_else(|e| {
                panic!(
                    "UCX was not found ({e}). The `ucx` feature of tessera-transfer needs the \
                     system library and headers: on Debian/Ubuntu `apt-get install libucx-dev \
                     libclang-dev pkg-config`"
                )
            });
        let bindings = bindgen::Builder::default()
            .header("wrapper.h")
            .clang_args(
                ucx.include_paths
                    .iter()
                    .map(|p| format!("-I{}", p.display())),
            )
            .allowlist_function("ucp_.*|ucs_.*")
            .allowlist_type("ucp_.*|ucs_.*")
            .allowlist_var("UCP_.*|UCS_.*")
            .allowlist_type("sockaddr_in|sockaddr_in6|sockaddr_storage")
            .allowlist_var("AF_INET|AF_INET6")
            // C enums become typed constants with their C names (`UCS_OK`, `UCP_FEATURE_RMA`).
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .derive_default(true)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
            .generate()
            .expect("bindgen could not parse the UCX headers");
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        bindings
            .write_to_file(out.join("bindings.rs"))
            .expect("write bindings.rs");
    }
}
