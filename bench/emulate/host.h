// Host-side helpers of the emulators (main.cpp, fold_main.cpp, onepass_main.cpp): buffers of exactly a
// launch's size (16-byte aligned, so AddressSanitizer sees any access past them) and raw file I/O.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

template <typename T>
static T* buffer(long long count) {
    return static_cast<T*>(aligned_alloc(16, ((count * sizeof(T) + 15) / 16) * 16));
}

inline void load_file(const std::string& path, void* p, long long bytes) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f || fread(p, 1, bytes, f) != static_cast<size_t>(bytes)) {
        fprintf(stderr, "cannot read %s\n", path.c_str());
        exit(2);
    }
    fclose(f);
}

inline void save_file(const std::string& path, const void* p, long long bytes) {
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(p, 1, bytes, f);
    fclose(f);
}
